/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Socket-level load balancing: the cgroup/sock_addr hooks rewrite the destination at
 * connect() and at sendmsg() of unconnected UDP, before any packet exists, and record
 * (socket, backend) -> frontend so that recvmsg() and getpeername() show the frontend the
 * application asked for (a DNS client checks the source of the answer). The packets then
 * carry the backend's address from the start: no per-packet NAT and no conntrack entry,
 * at tc or anywhere else.
 *
 * Records. A socket translated at connect() (TCP, connected UDP) has one backend: its
 * record (struct kbp_sock_peer) goes to the slot of kbp_sock_slots its cookie names
 * (cookie % KBP_SOCK_SLOTS), taken with a compare-and-swap and freed by sock_release;
 * cookies count up, so the slots of live sockets rarely meet. A socket whose slot another
 * live socket holds records elsewhere: a TCP socket in its socket storage (kbp_sock_peer),
 * a UDP socket in the kbp_sock_rev LRU, where the agent can read it. Those cost an
 * allocation or an LRU update (about 0.35 µs of the connect hook's 0.55, PB-2 in
 * bench/README.md); a slot costs a few stores. A reader trusts a slot only under its own
 * cookie, which the kernel never hands out twice, so a slot left held (sock_release did
 * not see the socket, docs/ebpf.md) wastes that slot and misleads nobody. An unconnected UDP
 * socket may send to many backends: (cookie, backend) -> frontend in kbp_sock_rev.
 *
 * Whose sockets (sock_client_of): the node's own network namespace
 * (kbp_config.host_netns_cookie) when kbp_config.sock_lb has KBP_SOCK_LB_HOST, and the
 * pods' namespaces the agent listed in kbp_pods (netns cookie -> the pod's addresses)
 * when it has KBP_SOCK_LB_PODS. A socket of any other namespace (a pod the agent has not
 * found yet, a namespace that is no pod) is left alone: its packets meet the tc hooks on
 * the pod's veth, which translate them as before.
 *
 * What the hooks decide (the tc path's rules, with the code the tc path uses):
 *   - The set is the internal one (lb_set_for_pods): clusterBackends, or localBackends
 *     for an internalTrafficPolicy Local ClusterIP; external frontends reached from the
 *     node or a pod use clusterBackends too (docs/nodestate.md).
 *   - The backend is chosen by lb_select_backend_by, tc's rule: affinity first, then a
 *     slot by hash. A socket that has its source port already (one bound explicitly, and
 *     every UDP socket at sendmsg(), which the kernel binds before the hook runs) hashes
 *     its 5-tuple with lb_flow_hash: the backend tc would pick for it, the same for every
 *     datagram of an unconnected UDP socket, as conntrack would keep it. A TCP socket at
 *     connect() has no port yet, so the hash is of the socket cookie and the frontend:
 *     sockets spread evenly over the set. When the set changes the slot may name another
 *     backend, and an unconnected socket's next datagram goes there.
 *   - The client address (ClientIP affinity, loadBalancerSourceRanges) is the address the
 *     socket is bound to, else the pod's address of the frontend's family (kbp_pods), or
 *     for the node's sockets the node's address (kbp_config.node_addr4/6): the source is
 *     chosen by routing after the hook; a pod has one address per family, and towards a
 *     Service a node's source is its primary address on a node with one.
 *   - loadBalancerSourceRanges guard a LoadBalancer VIP against pods and the node too, as
 *     kube-proxy's firewall chain does.
 *   - Where tc would drop or reject a packet, the syscall fails instead: ECONNREFUSED
 *     when the service has no endpoints anywhere (kube-proxy's REJECT), EHOSTUNREACH
 *     when endpoints exist elsewhere or the source ranges refuse the client (kube-proxy's
 *     DROP would leave connect() hanging until its timeout; failing at once says the
 *     same, sooner). The errno is set with bpf_set_retval(), which the kernel allows for
 *     the connect and sendmsg hooks since 5.18 (the programs do not load on older
 *     kernels; a rejecting program without it would mean EPERM). Counted in kbp_drops
 *     like packets, with 0 bytes.
 *   - Hairpin needs nothing: a pod that is its own Service's backend connects to its own
 *     address, which its namespace delivers locally.
 *   - A bound source port. Translating at connect() makes the backend's tuple the
 *     socket's own, and the kernel refuses a TCP connect() whose tuple another socket of
 *     the namespace holds (EADDRNOTAVAIL: the same port used for two Services that share
 *     a backend, at once or within the first connection's TIME_WAIT), where kube-proxy's
 *     NAT would have remapped the port. So a pod's socket that has its port before
 *     connect() (bound explicitly) is checked first (sock_tuple_taken): when a socket of
 *     the pod's namespace holds the translated tuple (TCP: established or TIME_WAIT; UDP:
 *     connected to that backend), or tc's conntrack has a flow under it, the hook leaves
 *     the connection untranslated and tc translates it per packet, with the port remapped
 *     (sock_leave_to_tc writes the flow's entries for tc, since tc cannot see the other
 *     socket). An unconnected UDP socket that sends to two frontends sharing a backend
 *     is handled the same way for the second one (its kbp_sock_rev record names the
 *     first). Sockets the kernel gives a port to after the hook (every unbound TCP or
 *     UDP connect()) pay nothing for this. The node's own sockets have no tc to fall back
 *     to: theirs are translated as before.
 *   - Only TCP and UDP sockets (ctx->protocol) are translated; SCTP passes, as at tc.
 *   - A connected socket keeps the backend it was given. When that backend leaves the
 *     service, the agent destroys connected UDP sockets still pointed at it (they would
 *     never learn); TCP learns from the backend (RST, timeouts), as under kube-proxy.
 *
 * IPv6 sockets may name IPv4 frontends as v4-mapped addresses (::ffff:a.b.c.d, a
 * dual-stack socket): the kernel runs only the IPv6 hooks for them, so those hooks look
 * the IPv4 frontend up and write the backend back v4-mapped.
 */
#ifndef KBP_LIB_SOCK_H
#define KBP_LIB_SOCK_H

#include <uapi/asm-generic/errno.h>

#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/counters.h"
#include "lib/lb.h"
#include "lib/maps.h"
#include "lib/parse.h"

/* struct bpf_sock.family values: include/linux/socket.h, which is not uapi (bcc happens
 * to provide them; say so rather than rely on it). */
#ifndef AF_INET
#define AF_INET 2
#endif /* AF_INET */
#ifndef AF_INET6
#define AF_INET6 10
#endif /* AF_INET6 */

/* What a cgroup sock_addr program returns: 1 lets the syscall go on, 0 fails it (with
 * EPERM, or the errno given to bpf_set_retval). */
#define KBP_SOCK_ALLOW 1
#define KBP_SOCK_REJECT 0

/* bcc 0.26 declares bpf_get_socket_cookie() as returning u32; the cookie is 64 bits. */
static __u64 (*kbp_socket_cookie)(void *ctx) = (void *)BPF_FUNC_get_socket_cookie;

/* An address as a socket hook sees it, in the ABI's form (IPv4 in word 0). */
struct sock_user_addr {
	__be32 addr[4];
	__be16 port; /* network order; a bound socket's port (0: none yet) */
	__u8 family; /* KBP_FAMILY_* after unmapping v4-mapped IPv6 addresses */
	__u8 mapped; /* came as (and goes back as) ::ffff:a.b.c.d */
};

/* Whose socket a hook runs for, when it is one the hooks translate: the addresses it
 * is judged by when it is not bound to one. */
struct sock_client {
	const __be32 *addr4; /* the pod's or the node's IPv4 address (word 0; 0: none) */
	const __be32 *addr6;
	__u8 pod; /* a pod's socket: its packets meet tc on the pod's veth */
};

/* Is this socket one the connect/sendmsg hooks translate (kbp_config.sock_lb, `config`
 * as written by the agent), and whose: the node's (its network namespace is the node's)
 * or a pod's (its namespace is in kbp_pods)? 0 for any other socket. */
static __always_inline int sock_client_of(void *ctx, const struct kbp_config *config,
					  struct sock_client *client)
{
	struct kbp_pod *pod;
	__u64 netns;

	netns = bpf_get_netns_cookie(ctx);
	if (config->host_netns_cookie != 0 && netns == config->host_netns_cookie) {
		if (!(config->sock_lb & KBP_SOCK_LB_HOST))
			return 0;
		client->addr4 = config->node_addr4;
		client->addr6 = config->node_addr6;
		return 1;
	}
	if (!(config->sock_lb & KBP_SOCK_LB_PODS))
		return 0;
	pod = map_lookup_pod(&netns);
	if (!pod)
		return 0;
	client->addr4 = pod->addr4;
	client->addr6 = pod->addr6;
	client->pod = 1;
	return 1;
}

/* IPPROTO_TCP / IPPROTO_UDP for the sockets we translate, 0 for any other. */
static __always_inline __u8 sock_proto_of(__u32 protocol)
{
	if (protocol == IPPROTO_TCP || protocol == IPPROTO_UDP)
		return protocol;
	return 0;
}

/* An IPv6 address as four words into `a`: a v4-mapped one (::ffff:a.b.c.d) becomes the
 * IPv4 address, marked `mapped`. */
static __always_inline void sock_addr_of_ip6(__be32 w0, __be32 w1, __be32 w2, __be32 w3,
					     struct sock_user_addr *a)
{
	if (w0 == 0 && w1 == 0 && w2 == bpf_htonl(0x0000ffff)) {
		a->addr[0] = w3;
		a->family = KBP_FAMILY_IPV4;
		a->mapped = 1;
		return;
	}
	a->addr[0] = w0;
	a->addr[1] = w1;
	a->addr[2] = w2;
	a->addr[3] = w3;
	a->family = KBP_FAMILY_IPV6;
}

/* The user address of an IPv4 hook: connect/sendmsg destination, recvmsg source,
 * getpeername peer. */
static __always_inline void sock4_read_user(struct bpf_sock_addr *ctx, struct sock_user_addr *a)
{
	a->addr[0] = ctx->user_ip4;
	a->port = (__be16)ctx->user_port;
	a->family = KBP_FAMILY_IPV4;
}

static __always_inline void sock4_write_user(struct bpf_sock_addr *ctx, const __be32 *addr,
					     __be16 port)
{
	ctx->user_ip4 = addr[0];
	ctx->user_port = (__u32)port;
}

/* The same for an IPv6 hook; a v4-mapped address becomes an IPv4 one. */
static __always_inline void sock6_read_user(struct bpf_sock_addr *ctx, struct sock_user_addr *a)
{
	sock_addr_of_ip6(ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3],
			 a);
	a->port = (__be16)ctx->user_port;
}

/* Write an address of `a`'s family back into an IPv6 hook (v4-mapped when it came so). */
static __always_inline void sock6_write_user(struct bpf_sock_addr *ctx,
					     const struct sock_user_addr *a, const __be32 *addr,
					     __be16 port)
{
	if (a->mapped) {
		ctx->user_ip6[0] = 0;
		ctx->user_ip6[1] = 0;
		ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
		ctx->user_ip6[3] = addr[0];
	} else {
		ctx->user_ip6[0] = addr[0];
		ctx->user_ip6[1] = addr[1];
		ctx->user_ip6[2] = addr[2];
		ctx->user_ip6[3] = addr[3];
	}
	ctx->user_port = (__u32)port;
}

/* The address and port an IPv4 socket is bound to (0: unbound, the usual case). */
static __always_inline void sock4_read_bound(struct bpf_sock_addr *ctx,
					     struct sock_user_addr *a)
{
	struct bpf_sock *sk = ctx->sk;

	a->addr[0] = sk->src_ip4;
	a->port = bpf_htons((__u16)sk->src_port); /* struct bpf_sock: host order */
	a->family = KBP_FAMILY_IPV4;
}

/* The same for an IPv6 socket (:: unbound; a v4-mapped address becomes IPv4). */
static __always_inline void sock6_read_bound(struct bpf_sock_addr *ctx,
					     struct sock_user_addr *a)
{
	struct bpf_sock *sk = ctx->sk;

	sock_addr_of_ip6(sk->src_ip6[0], sk->src_ip6[1], sk->src_ip6[2], sk->src_ip6[3], a);
	a->port = bpf_htons((__u16)sk->src_port);
}

/* The tuple the load balancer sees: the client is the bound address when there is one
 * of the frontend's family, else the pod's or node's address (see the header comment);
 * the bound port if any (0: not chosen yet); the frontend as the destination. Returns 0
 * when the client has no address of the frontend's family (left to the stack). */
static __always_inline int sock_tuple_of(const struct sock_client *client,
					 const struct sock_user_addr *frontend,
					 const struct sock_user_addr *bound, __u8 proto,
					 struct kbp_tuple *t)
{
	if (bound->family == frontend->family &&
	    (bound->addr[0] | bound->addr[1] | bound->addr[2] | bound->addr[3]))
		__builtin_memcpy(t->saddr, bound->addr, sizeof(t->saddr));
	else if (frontend->family == KBP_FAMILY_IPV4)
		t->saddr[0] = client->addr4[0];
	else
		__builtin_memcpy(t->saddr, client->addr6, sizeof(t->saddr));
	if ((t->saddr[0] | t->saddr[1] | t->saddr[2] | t->saddr[3]) == 0)
		return 0;
	__builtin_memcpy(t->daddr, frontend->addr, sizeof(t->daddr));
	t->sport = bound->port;
	t->dport = frontend->port;
	t->proto = proto;
	t->family = frontend->family;
	return 1;
}

/* MurmurHash3's 64-bit finalizer: every input bit moves every output bit, so consecutive
 * socket cookies land on unrelated slots. */
static __always_inline __u64 __sock_fmix64(__u64 h)
{
	h ^= h >> 33;
	h *= 0xff51afd7ed558ccdULL;
	h ^= h >> 33;
	h *= 0xc4ceb9fe1a85ec53ULL;
	h ^= h >> 33;
	return h;
}

/* The slot of the set for this socket and frontend (see the header comment). */
static __always_inline __u32 sock_slot_hash(__u64 cookie, const struct kbp_tuple *t)
{
	__u64 h = __sock_fmix64(cookie);

	h = __sock_fmix64(h ^ (((__u64)t->daddr[0] << 32) | t->daddr[1]));
	h = __sock_fmix64(h ^ (((__u64)t->daddr[2] << 32) | t->daddr[3]));
	h = __sock_fmix64(h ^ (((__u64)t->dport << 8) | t->proto));
	return (__u32)(h >> 32);
}

/* The hash lb_select_backend_by picks the slot with (see the header comment): tc's flow
 * hash when the socket has its source port already, else the socket's own. */
static __always_inline __u32 sock_select_hash(__u64 cookie, const struct kbp_tuple *t)
{
	if (t->sport != 0)
		return lb_flow_hash(t);
	return sock_slot_hash(cookie, t);
}

/* Fail the syscall with `err` (a positive errno), counted under `reason`. */
static __always_inline int sock_refuse(const struct kbp_service *svc, __u32 reason, int err)
{
	count_service_drop(svc->service_id, reason, 0);
	bpf_set_retval(-err);
	return KBP_SOCK_REJECT;
}

/* An empty set: REJECT (no endpoints anywhere) or DROP (endpoints elsewhere). */
static __always_inline int sock_refuse_empty_set(const struct kbp_service *svc)
{
	if (svc->flags & KBP_SVC_F_HAS_ENDPOINTS)
		return sock_refuse(svc, KBP_DROP_NO_BACKEND, EHOSTUNREACH);
	return sock_refuse(svc, KBP_DROP_REJECTED, ECONNREFUSED);
}

/* Remember that this socket's `backend` stands for `frontend`. Returns 1 when the entry
 * is new (the socket's first flow to this backend: a new flow for the counters and for
 * affinity), 0 when it was already there. An unconnected UDP socket comes here on every
 * sendmsg(), hence the lookup before the (costlier) update. A failed update is ignored:
 * the flow still works, only recvmsg/getpeername would show the backend. `keep_other`: an
 * entry that names another frontend for this backend is kept and -1 returned (the socket
 * sends to two frontends that share this backend, from one port: see sock_leave_to_tc). */
static __always_inline int sock_remember_frontend(__u64 cookie, const struct kbp_backend *backend,
						  const struct sock_user_addr *frontend,
						  __u32 service_id, int keep_other)
{
	struct kbp_sock_key key = {};
	struct kbp_sock_rev rev = {};
	struct kbp_sock_rev *known;

	key.cookie = cookie;
	__builtin_memcpy(key.addr, backend->addr, sizeof(key.addr));
	key.port = backend->port;
	key.family = backend->family;
	known = map_lookup_sock_rev(&key);
	if (known && lb_addr_equal(known->addr, frontend->addr) && known->port == frontend->port &&
	    known->service_id == service_id)
		return 0;
	if (known && keep_other && (known->port != frontend->port ||
				    !lb_addr_equal(known->addr, frontend->addr)))
		return -1;
	__builtin_memcpy(rev.addr, frontend->addr, sizeof(rev.addr));
	rev.port = frontend->port;
	rev.service_id = service_id;
	map_update_sock_rev(&key, &rev);
	return 1;
}

/* Where a connected socket's record goes (see "Records" above): its slot of
 * kbp_sock_slots when the slot is free or already its own, else (TCP only) its own
 * kbp_sock_peer, created. `*fresh` says the slot was just taken: what it holds is its last
 * holder's, not this socket's. NULL when neither can be had. */
static __always_inline struct kbp_sock_peer *sock_peer_claim(struct bpf_sock_addr *ctx,
							     __u64 cookie, int *fresh)
{
	struct kbp_sock_slot *slot = map_sock_slot(cookie);
	__u64 holder;

	*fresh = 0;
	if (slot) {
		/* One compare-and-swap: two sockets that name the slot at once on two CPUs
		 * never both take it. */
		holder = __sync_val_compare_and_swap(&slot->cookie, 0, cookie);
		*fresh = holder == 0;
		if (holder == 0 || holder == cookie)
			return &slot->peer;
	}
	if (ctx->protocol != IPPROTO_TCP)
		return NULL; /* the agent reads UDP records; it cannot read socket storage */
	return map_sock_peer(ctx->sk, 1);
}

/* The record of a connected socket, if it has one: its slot if it holds it, else a TCP
 * socket's kbp_sock_peer. */
static __always_inline struct kbp_sock_peer *sock_peer_of(struct bpf_sock *sk, __u64 cookie)
{
	struct kbp_sock_slot *slot = map_sock_slot(cookie);

	if (slot && slot->cookie == cookie)
		return &slot->peer;
	if (sk->protocol != IPPROTO_TCP)
		return NULL;
	return map_sock_peer(sk, 0);
}

/* A connected UDP socket connect()ed again, elsewhere: datagrams of its previous backend
 * may still wait in its queue, so that backend's record moves to kbp_sock_rev (left to
 * the LRU) before the slot takes the new one. */
static __always_inline void sock_keep_previous(__u64 cookie, const struct kbp_sock_peer *old)
{
	struct kbp_sock_key key = {.cookie = cookie};
	struct kbp_sock_rev rev = {};

	__builtin_memcpy(key.addr, old->backend, sizeof(key.addr));
	key.port = old->backend_port;
	key.family = old->family;
	__builtin_memcpy(rev.addr, old->frontend, sizeof(rev.addr));
	rev.port = old->frontend_port;
	rev.service_id = old->service_id;
	map_update_sock_rev(&key, &rev);
}

/* The same as sock_remember_frontend for a socket at connect(), in the record
 * sock_peer_claim finds (kbp_sock_rev when it finds none). */
static __always_inline int sock_remember_peer(struct bpf_sock_addr *ctx, __u64 cookie,
					      const struct kbp_backend *backend,
					      const struct sock_user_addr *frontend,
					      __u32 service_id)
{
	int fresh;
	struct kbp_sock_peer *peer = sock_peer_claim(ctx, cookie, &fresh);

	if (!peer)
		return sock_remember_frontend(cookie, backend, frontend, service_id, 0);
	if (!fresh && peer->service_id == service_id && peer->backend_port == backend->port &&
	    peer->frontend_port == frontend->port && lb_addr_equal(peer->backend, backend->addr) &&
	    lb_addr_equal(peer->frontend, frontend->addr))
		return 0;
	if (!fresh && peer->backend_port != 0 && ctx->protocol == IPPROTO_UDP)
		sock_keep_previous(cookie, peer);
	__builtin_memcpy(peer->backend, backend->addr, sizeof(peer->backend));
	__builtin_memcpy(peer->frontend, frontend->addr, sizeof(peer->frontend));
	peer->backend_port = backend->port;
	peer->frontend_port = frontend->port;
	peer->service_id = service_id;
	peer->family = backend->family;
	return 1;
}

/* A UDP socket's first datagram to `backend` (its port is known at sendmsg()): a reply
 * entry that tc left for an earlier flow with the same ports would disguise the backend's
 * answers as the frontend's, and this socket would drop them. tc forgets such entries at
 * a TCP SYN (ct_forget_reply_to); UDP has no SYN, so the hook does it. A TCP socket has
 * no port yet at connect(): its SYN does. */
static __always_inline void sock_forget_tc_flow(const struct kbp_tuple *t,
						const struct kbp_backend *backend)
{
	struct kbp_tuple direct = *t;

	if (t->proto != IPPROTO_UDP || t->sport == 0)
		return;
	__builtin_memcpy(direct.daddr, backend->addr, sizeof(direct.daddr));
	direct.dport = backend->port;
	ct_forget_reply_to(&direct);
}

/* Who holds the tuple a pod's socket bound to port t->sport would have once pointed at
 * `backend` (see "A bound source port" above). */
#define SOCK_TUPLE_FREE 0
#define SOCK_TUPLE_SOCKET 1 /* a socket of the pod's namespace has it as its own tuple */
#define SOCK_TUPLE_TC 2     /* kbp_ct has a reply entry under it: a flow tc translated */

/* Is this socket (a UDP one the lookup found) connected to `backend`? The fields are read
 * first, each at its constant offset: the verifier allows no pointer arithmetic on a
 * socket, which the compiler would otherwise use for the address words. */
static __always_inline int sock_is_connected_to(struct bpf_sock *sk,
						const struct kbp_backend *backend)
{
	__be32 peer[4];
	__be16 port = (__be16)sk->dst_port;

	if (backend->family == KBP_FAMILY_IPV4) {
		peer[0] = sk->dst_ip4;
		return port == backend->port && peer[0] == backend->addr[0];
	}
	peer[0] = sk->dst_ip6[0];
	peer[1] = sk->dst_ip6[1];
	peer[2] = sk->dst_ip6[2];
	peer[3] = sk->dst_ip6[3];
	return port == backend->port && lb_addr_equal(peer, backend->addr);
}

/* The lookups of SOCK_TUPLE_*: the kernel's socket tables of the socket's own namespace,
 * asked as for a packet the backend would send to the client (TCP: established and
 * TIME_WAIT sockets count, a listener does not; UDP: a socket connected to the backend),
 * then tc's conntrack for a reply entry under the same tuple, unless kbp_ct_gate says no
 * reply entry can be there (the miss in a large kbp_ct cost about 290 ns, the gate's
 * answer a few: PB-2 in bench/README.md). */
static __always_inline int sock_tuple_taken(struct bpf_sock_addr *ctx, const struct kbp_tuple *t,
					    const struct kbp_backend *backend)
{
	struct bpf_sock_tuple tuple = {};
	struct kbp_ct_key key = {};
	struct bpf_sock *sk;
	int size = sizeof(tuple.ipv4);
	int taken = 0;

	if (t->family == KBP_FAMILY_IPV4) {
		tuple.ipv4.saddr = backend->addr[0];
		tuple.ipv4.daddr = t->saddr[0];
		tuple.ipv4.sport = backend->port;
		tuple.ipv4.dport = t->sport;
	} else {
		__builtin_memcpy(tuple.ipv6.saddr, backend->addr, sizeof(tuple.ipv6.saddr));
		__builtin_memcpy(tuple.ipv6.daddr, t->saddr, sizeof(tuple.ipv6.daddr));
		tuple.ipv6.sport = backend->port;
		tuple.ipv6.dport = t->sport;
		size = sizeof(tuple.ipv6);
	}
	if (t->proto == IPPROTO_TCP) {
		sk = bpf_skc_lookup_tcp(ctx, &tuple, size, BPF_F_CURRENT_NETNS, 0);
		if (sk) {
			taken = sk->state != BPF_TCP_LISTEN;
			bpf_sk_release(sk);
		}
	} else {
		sk = bpf_sk_lookup_udp(ctx, &tuple, size, BPF_F_CURRENT_NETNS, 0);
		if (sk) {
			taken = sock_is_connected_to(sk, backend);
			bpf_sk_release(sk);
		}
	}
	if (taken)
		return SOCK_TUPLE_SOCKET;
	if (!ct_reply_possible(backend->port, kbp_addr_fold(backend->addr), kbp_addr_fold(t->saddr)))
		return SOCK_TUPLE_FREE;
	__ct_reply_key(t, backend->addr, backend->port, 0, &key);
	if (map_lookup_ct(&key))
		return SOCK_TUPLE_TC;
	return SOCK_TUPLE_FREE;
}

/* Leave a pod's connect() or datagram to `t`'s frontend untranslated, for tc on the pod's
 * veth to translate per packet (see "A bound source port" above). The backend is the one
 * the hook chose, which is tc's choice too (the flow hash of the same tuple). When a
 * socket of the pod holds the tuple (SOCK_TUPLE_SOCKET) kbp_ct knows nothing of it, so the
 * flow's entries are written here with the client's port remapped, as tc would after a
 * clash it could see; a flow tc holds (SOCK_TUPLE_TC) is tc's own clash to settle, and a
 * hairpin flow's source is rewritten anyway. A datagram of a UDP flow already written
 * adds nothing. An earlier flow of the same tuple (this socket's port connect()ed to this
 * frontend before) is over: its reply entry goes, as tc removes it when a SYN starts a
 * new flow on the tuple, or every reconnect would hold one more SNAT port. */
static __always_inline int sock_leave_to_tc(const struct kbp_tuple *t,
					    const struct kbp_service *svc, __u32 backend_id,
					    const struct kbp_backend *backend,
					    struct kbp_affinity *affinity, __u64 now, int taken)
{
	struct kbp_ct_entry *flow;

	if (taken != SOCK_TUPLE_SOCKET || lb_addr_equal(t->saddr, backend->addr))
		return KBP_SOCK_ALLOW;
	flow = ct_lookup_forward(t);
	if (flow && t->proto == IPPROTO_UDP && (flow->flags & KBP_CT_F_SPORT) &&
	    ct_backend_is_current(flow, svc) && flow->backend_id == backend_id)
		return KBP_SOCK_ALLOW;
	if (flow)
		ct_forget_reply_of(t, flow);
	if (ct_create_clashing(t, svc, backend_id, backend, kbp_now()))
		return sock_refuse(svc, KBP_DROP_NO_SNAT_PORT, EADDRNOTAVAIL);
	lb_refresh_affinity(t, svc, now, backend_id, affinity);
	count_new_flow(svc->service_id);
	return KBP_SOCK_ALLOW;
}

/* connect() (`connected`) or sendmsg() of a socket (bound to `bound`, if at all) to
 * `frontend`: on success `*backend_out` names the address to write; returns
 * KBP_SOCK_ALLOW with *backend_out NULL when the destination is not a service (or the
 * socket not ours), or KBP_SOCK_REJECT after setting the errno. */
static __always_inline int sock_lb_select(struct bpf_sock_addr *ctx,
					  const struct sock_user_addr *frontend,
					  const struct sock_user_addr *bound, __u32 protocol,
					  int connected, struct kbp_backend **backend_out)
{
	struct sock_client client = {};
	struct kbp_config *config;
	struct kbp_tuple t = {};
	struct kbp_service *svc;
	struct kbp_backend *backend;
	struct kbp_affinity *affinity;
	__u32 set_id, count, backend_id = 0;
	__u8 proto = sock_proto_of(protocol);
	__u64 cookie, now;
	int taken, known;

	*backend_out = NULL;
	/* Most connect()s go to no Service: the port, then the frontend, say so before the
	 * socket's owner is looked up (nothing is looked up before the agent wrote the
	 * config, or with --socket-lb off). */
	config = map_lookup_config();
	if (!proto || !config || config->sock_lb == 0 ||
	    !map_port_used(frontend->port, KBP_PORT_F_FRONTEND))
		return KBP_SOCK_ALLOW;
	__builtin_memcpy(t.daddr, frontend->addr, sizeof(t.daddr));
	t.dport = frontend->port;
	t.proto = proto;
	t.family = frontend->family;
	svc = __lb_lookup_service(&t);
	if (!svc)
		return KBP_SOCK_ALLOW;
	if (!sock_client_of(ctx, config, &client))
		return KBP_SOCK_ALLOW;
	if (!sock_tuple_of(&client, frontend, bound, proto, &t))
		return KBP_SOCK_ALLOW;
	if (!lb_source_admitted(&t, svc))
		return sock_refuse(svc, KBP_DROP_SOURCE_RANGE, EHOSTUNREACH);
	lb_set_for_pods(svc, &set_id, &count);
	if (count == 0)
		return sock_refuse_empty_set(svc);
	cookie = kbp_socket_cookie(ctx);
	now = svc->flags & KBP_SVC_F_AFFINITY ? kbp_now() : 0; /* only affinity reads it */
	backend = lb_select_backend_by(&t, svc, set_id, count, now, sock_select_hash(cookie, &t),
				       &backend_id, &affinity);
	if (!backend)
		return sock_refuse(svc, KBP_DROP_BACKEND_GONE, EHOSTUNREACH);
	/* Service ids are per family: a backend of another family means a corrupt entry. */
	if (backend->family != frontend->family)
		return sock_refuse(svc, KBP_DROP_NAT_FAILED, EHOSTUNREACH);
	if (connected && t.sport != 0 && client.pod &&
	    (taken = sock_tuple_taken(ctx, &t, backend)) != SOCK_TUPLE_FREE)
		return sock_leave_to_tc(&t, svc, backend_id, backend, affinity, now, taken);
	known = connected ? sock_remember_peer(ctx, cookie, backend, frontend, svc->service_id)
			  : sock_remember_frontend(cookie, backend, frontend, svc->service_id,
						   client.pod);
	if (known < 0)
		return sock_leave_to_tc(&t, svc, backend_id, backend, affinity, now,
					SOCK_TUPLE_SOCKET);
	if (known) {
		lb_refresh_affinity(&t, svc, now, backend_id, affinity);
		count_new_flow(svc->service_id);
		sock_forget_tc_flow(&t, backend);
	}
	*backend_out = backend;
	return KBP_SOCK_ALLOW;
}

/* connect4 / sendmsg4 (`connected`: which): point the socket at a backend of the frontend
 * it names. */
static __always_inline int sock4_to_backend(struct bpf_sock_addr *ctx, int connected)
{
	struct sock_user_addr frontend = {}, bound = {};
	struct kbp_backend *backend;
	int verdict;

	sock4_read_user(ctx, &frontend);
	sock4_read_bound(ctx, &bound);
	verdict = sock_lb_select(ctx, &frontend, &bound, ctx->protocol, connected, &backend);
	if (backend)
		sock4_write_user(ctx, backend->addr, backend->port);
	return verdict;
}

/* connect6 / sendmsg6, v4-mapped destinations included. */
static __always_inline int sock6_to_backend(struct bpf_sock_addr *ctx, int connected)
{
	struct sock_user_addr frontend = {}, bound = {};
	struct kbp_backend *backend;
	int verdict;

	sock6_read_user(ctx, &frontend);
	sock6_read_bound(ctx, &bound);
	verdict = sock_lb_select(ctx, &frontend, &bound, ctx->protocol, connected, &backend);
	if (backend)
		sock6_write_user(ctx, &frontend, backend->addr, backend->port);
	return verdict;
}

/* The frontend this socket's peer `peer` (a backend) stands for, or NULL. Whatever
 * kbp_config.sock_lb says now: a socket translated before a mode switch still shows its
 * frontend. Only peers on a port some backend served on can be in kbp_sock_rev. A TCP
 * socket's is in its kbp_sock_peer (sock_remember_peer), copied to `*found`. */
static __always_inline struct kbp_sock_rev *sock_frontend_of(struct bpf_sock_addr *ctx,
							     const struct sock_user_addr *peer,
							     struct kbp_sock_rev *found)
{
	struct kbp_sock_key key = {};
	struct kbp_sock_peer *mine;

	if (!map_port_used(peer->port, KBP_PORT_F_BACKEND))
		return NULL;
	key.cookie = kbp_socket_cookie(ctx);
	if ((mine = sock_peer_of(ctx->sk, key.cookie)) &&
	    mine->family == peer->family && mine->backend_port == peer->port &&
	    lb_addr_equal(mine->backend, peer->addr)) {
		__builtin_memcpy(found->addr, mine->frontend, sizeof(found->addr));
		found->port = mine->frontend_port;
		found->service_id = mine->service_id;
		return found;
	}
	__builtin_memcpy(key.addr, peer->addr, sizeof(key.addr));
	key.port = peer->port;
	key.family = peer->family;
	return map_lookup_sock_rev(&key);
}

/* recvmsg4 / getpeername4: show the frontend instead of the backend. These hooks must
 * always allow. */
static __always_inline int sock4_to_frontend(struct bpf_sock_addr *ctx)
{
	struct sock_user_addr peer = {};
	struct kbp_sock_rev found = {}, *rev;

	sock4_read_user(ctx, &peer);
	rev = sock_frontend_of(ctx, &peer, &found);
	if (rev)
		sock4_write_user(ctx, rev->addr, rev->port);
	return KBP_SOCK_ALLOW;
}

static __always_inline int sock6_to_frontend(struct bpf_sock_addr *ctx)
{
	struct sock_user_addr peer = {};
	struct kbp_sock_rev found = {}, *rev;

	sock6_read_user(ctx, &peer);
	rev = sock_frontend_of(ctx, &peer, &found);
	if (rev)
		sock6_write_user(ctx, &peer, rev->addr, rev->port);
	return KBP_SOCK_ALLOW;
}

/* sock_release: free the slot of a connected socket (TCP, connected UDP), or delete a
 * connected UDP socket's kbp_sock_rev entry, so that slots and the LRU hold live sockets,
 * not closed ones. A TCP socket without a slot has its record in kbp_sock_peer, which goes
 * with it (or, when that could not be created, in the LRU, left to it). Entries of
 * unconnected UDP sockets (one per backend they sent to) are left to the LRU: cookies
 * never repeat, so a stale entry is never read, only evicted. */
static __always_inline int sock_forget(struct bpf_sock *ctx)
{
	struct sock_user_addr peer = {};
	struct kbp_sock_key key = {};
	struct kbp_sock_slot *slot;

	/* A slot is freed whatever the socket's peer is now: a connect() that failed after
	 * the hook, or connect(AF_UNSPEC), leaves it no destination port. */
	if (!sock_proto_of(ctx->protocol) ||
	    (ctx->dst_port != 0 && !map_port_used((__be16)ctx->dst_port, KBP_PORT_F_BACKEND)))
		return KBP_SOCK_ALLOW;
	key.cookie = kbp_socket_cookie(ctx);
	slot = map_sock_slot(key.cookie);
	if (slot && slot->cookie == key.cookie) {
		slot->cookie = 0;
		return KBP_SOCK_ALLOW;
	}
	if (ctx->protocol == IPPROTO_TCP || ctx->dst_port == 0)
		return KBP_SOCK_ALLOW;
	if (ctx->family == AF_INET) {
		peer.addr[0] = ctx->dst_ip4;
		peer.family = KBP_FAMILY_IPV4;
	} else if (ctx->family == AF_INET6) {
		sock_addr_of_ip6(ctx->dst_ip6[0], ctx->dst_ip6[1], ctx->dst_ip6[2], ctx->dst_ip6[3],
				 &peer);
	} else {
		return KBP_SOCK_ALLOW;
	}
	__builtin_memcpy(key.addr, peer.addr, sizeof(key.addr));
	key.port = ctx->dst_port;
	key.family = peer.family;
	map_delete_sock_rev(&key);
	return KBP_SOCK_ALLOW;
}

#endif /* KBP_LIB_SOCK_H */
