/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Conntrack: a forward entry (client -> frontend, as the client sent it) remembers the
 * backend; a reply entry (backend -> client, as the backend sends it) remembers the
 * frontend to restore. Both are keyed by the packet's own tuple on the wire, so each hook
 * needs one lookup per packet and no state about which side it is on.
 */
#ifndef KBP_LIB_CONNTRACK_H
#define KBP_LIB_CONNTRACK_H

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/lb.h"

/* last_seen is written at most this often per entry: entries are shared by all CPUs,
 * and rewriting the same cache line on every packet costs more than the precision. */
#define KBP_CT_TOUCH_NS (1ULL * KBP_NS_PER_SEC)

/* The key of the packet's own tuple in direction `dir`. */
static __always_inline void ct_key_of_packet(const struct kbp_tuple *t, __u8 dir,
					     struct kbp_ct_key *key)
{
	__builtin_memcpy(key->saddr, t->saddr, sizeof(key->saddr));
	__builtin_memcpy(key->daddr, t->daddr, sizeof(key->daddr));
	key->sport = t->sport;
	key->dport = t->dport;
	key->proto = t->proto;
	key->family = t->family;
	key->dir = dir;
}

/* Could a packet from `port` (network order) at the address folded to `backend` to the
 * one folded to `client` (kbp_addr_fold) be a backend's reply of a flow tc translated?
 * A reply comes from a backend's port, so other source ports need no lookup (kbp_ports),
 * and neither do packets between addresses no translated flow joins (kbp_ct_gate: the
 * socket hooks' flows, direct connections to pods that are backends; a spare has its reply
 * entry's addresses, so the gate covers it too). Asked before the lookup, and by the pod
 * programs on the ports they read in place (parse_ports_in_place). */
static __always_inline int ct_reply_possible(__be16 port, __u32 backend, __u32 client)
{
	return map_port_used(port, KBP_PORT_F_BACKEND) && map_ct_reply_maybe(backend, client, port);
}

/* Is this packet a backend's reply of a translated flow? Both hooks ask first. */
static __always_inline struct kbp_ct_entry *__ct_reply_from_spare(struct kbp_ct_key *key);

static __always_inline struct kbp_ct_entry *__ct_lookup_reply(const struct kbp_tuple *t,
							      int spare)
{
	struct kbp_ct_key key = {};
	struct kbp_ct_entry *reply;

	if (!ct_reply_possible(t->sport, kbp_addr_fold(t->saddr), kbp_addr_fold(t->daddr)))
		return NULL;
	ct_key_of_packet(t, KBP_CT_REPLY, &key);
	reply = map_lookup_ct(&key);
	if (reply || !spare)
		return reply;
	return __ct_reply_from_spare(&key);
}

/* The reply entry, or its spare written back when the entry alone was lost. */
static __always_inline struct kbp_ct_entry *ct_lookup_reply(const struct kbp_tuple *t)
{
	return __ct_lookup_reply(t, 1);
}

static __always_inline struct kbp_ct_entry *ct_lookup_forward(const struct kbp_tuple *t)
{
	struct kbp_ct_key key = {};

	ct_key_of_packet(t, KBP_CT_FORWARD, &key);
	return map_lookup_ct(&key);
}

/* Does the entry's backend still serve the service at the address it recorded? Ids are
 * reused after deletion, hence the address and port comparison. */
static __always_inline int ct_backend_is_current(const struct kbp_ct_entry *entry,
						 const struct kbp_service *svc)
{
	struct kbp_backend *backend;

	if (entry->service_id != svc->service_id)
		return 0;
	backend = lb_backend_of_service(entry->backend_id, svc->service_id);
	return backend && backend->port == entry->port && lb_addr_equal(backend->addr, entry->addr);
}

/* Keep a forward entry for this packet? TCP segments other than a SYN always do, even
 * when the backend is gone, so a terminating pod drains its open connections (as
 * kube-proxy's conntrack does); a SYN (port reuse) or UDP only with a current backend.
 * Asking in this order spares established TCP the backend lookup. */
static __always_inline int ct_forward_is_usable(const struct kbp_ct_entry *entry,
						const struct kbp_service *svc,
						const struct kbp_tuple *t)
{
	if (t->proto == IPPROTO_TCP && !tuple_is_tcp_syn(t))
		return 1;
	/* A SYN on a flow that saw a FIN or RST starts a new connection on the same tuple
	 * (the client's TIME_WAIT ended, or it reset): new entries, not the closing ones. */
	if (entry->flags & KBP_CT_F_CLOSING)
		return 0;
	return ct_backend_is_current(entry, svc);
}

/* Count a conntrack event (KBP_CT_STAT_*). */
static __always_inline void ct_count(__u32 what)
{
	__u64 *n = map_lookup_ct_stats(&what);

	if (n)
		*n += 1;
}

/* A TCP segment other than a SYN that found no forward entry belongs to a flow whose
 * entries were evicted or expired: counted, so the agent can say so. Returns 1 for such
 * a lost flow (ct_create then looks for its remapped port), 0 for others. */
static __always_inline int ct_note_lost(const struct kbp_tuple *t,
					const struct kbp_ct_entry *flow)
{
	if (flow || t->proto != IPPROTO_TCP || (t->tcp_flags & KBP_TCP_SYN))
		return 0;
	ct_count(KBP_CT_STAT_LOST);
	return 1;
}

/* Note a packet of the flow: time (coarsely, see KBP_CT_TOUCH_NS) and FIN/RST. The agent's
 * collector reads both to decide when the flow has expired. */
static __always_inline void ct_touch(struct kbp_ct_entry *entry, const struct kbp_tuple *t,
				     __u64 now, __u8 flags)
{
	if (t->tcp_flags & (KBP_TCP_FIN | KBP_TCP_RST))
		flags |= KBP_CT_F_CLOSING;
	if (t->tcp_flags & KBP_TCP_RST)
		flags |= KBP_CT_F_RST;
	if ((entry->flags & flags) != flags)
		entry->flags |= flags;
	if (now - entry->last_seen > KBP_CT_TOUCH_NS)
		entry->last_seen = now;
}

/* A flow netfilter translated before this agent served its frontend (a forward entry
 * with backend_id KBP_CT_NETFILTER, seeded by the agent from the kernel's conntrack): its
 * packets pass untranslated, so netfilter's conntrack keeps the flow's NAT. Translating
 * them, even to the same backend, would give netfilter a new tuple whose reply tuple
 * clashes with its entry's, and it would remap the source port. A SYN (the tuple reused
 * by a new connection) is not left: it is a new flow of ours. Touched so the collector
 * keeps the entry while the flow lives (FIN/RST: it expires as a closing flow). */
static __always_inline int ct_left_to_netfilter(struct kbp_ct_entry *flow,
						const struct kbp_tuple *t, __u64 now)
{
	if (flow->backend_id != KBP_CT_NETFILTER || tuple_is_tcp_syn(t))
		return 0;
	ct_touch(flow, t, now, 0);
	return 1;
}

/* While the agent takes flows over from netfilter (kbp_config.handoff: during its first
 * apply, until it has seeded the KBP_CT_NETFILTER entries of the flows kube-proxy's rules
 * translated), a lost TCP segment (ct_note_lost: no entry of ours, not a SYN) is such a
 * flow's, opened before the seeding: it is left to netfilter like them. Asked only on the
 * lost path. */
static __always_inline int ct_handoff(void)
{
	struct kbp_config *cfg = map_lookup_config();

	return cfg && cfg->handoff;
}

/* The reply key of a forward flow to backend addr:port: the backend answers the client,
 * or, for hairpin, the frontend address the client's source was rewritten to. */
static __always_inline void __ct_reply_key(const struct kbp_tuple *t, const __be32 *backend_addr,
					   __be16 backend_port, int hairpin,
					   struct kbp_ct_key *key)
{
	__builtin_memcpy(key->saddr, backend_addr, sizeof(key->saddr));
	if (hairpin)
		__builtin_memcpy(key->daddr, t->daddr, sizeof(key->daddr));
	else
		__builtin_memcpy(key->daddr, t->saddr, sizeof(key->daddr));
	key->sport = backend_port;
	key->dport = t->sport;
	key->proto = t->proto;
	key->family = t->family;
	key->dir = KBP_CT_REPLY;
}

/* The reply key of the flow whose forward entry is `fwd` (the packet `t` its tuple): the
 * backend answered the SNAT address, or the client at its remapped port. */
static __always_inline void __ct_reply_key_of_forward(const struct kbp_tuple *t,
						      const struct kbp_ct_entry *fwd,
						      struct kbp_ct_key *key)
{
	__ct_reply_key(t, fwd->addr, fwd->port, fwd->flags & KBP_CT_F_HAIRPIN, key);
	if (fwd->flags & (KBP_CT_F_SNAT | KBP_CT_F_SPORT)) {
		__builtin_memcpy(key->daddr, fwd->nat_addr, sizeof(key->daddr));
		key->dport = fwd->nat_port;
	}
	key->pad = 0;
}

/* The forward key of the flow whose reply entry (or spare) `held` sits at `key`, the
 * reverse of __ct_reply_key_of_forward: the client as it sent (its port before a remap)
 * to the frontend. */
static __always_inline void __ct_forward_key_of_reply(const struct kbp_ct_key *key,
						      const struct kbp_ct_entry *held,
						      struct kbp_ct_key *fkey)
{
	if (held->flags & (KBP_CT_F_SNAT | KBP_CT_F_SPORT)) {
		__builtin_memcpy(fkey->saddr, held->nat_addr, sizeof(fkey->saddr));
		fkey->sport = held->nat_port;
	} else {
		/* hairpin: the client is the backend, the reply's source */
		if (held->flags & KBP_CT_F_HAIRPIN)
			__builtin_memcpy(fkey->saddr, key->saddr, sizeof(fkey->saddr));
		else
			__builtin_memcpy(fkey->saddr, key->daddr, sizeof(fkey->saddr));
		fkey->sport = key->dport;
	}
	__builtin_memcpy(fkey->daddr, held->addr, sizeof(fkey->daddr));
	fkey->dport = held->port;
	fkey->proto = key->proto;
	fkey->family = key->family;
	fkey->dir = KBP_CT_FORWARD;
	fkey->pad = 0;
}

/* A flow's reply entry is what turns its backend's answers back into the frontend's; lost
 * alone (evicted, or deleted), the answers would reach the client from the backend's
 * address and the client would reset the backend's connection. So a flow that lived a
 * second keeps a spare copy of its reply entry (KBP_CT_SPARE), written once by its
 * forward path (the forward entry then carries KBP_CT_F_SPARE) at the coarse touch, so
 * short flows, and every packet but one of long ones, pay nothing. Uses the scratch key. */
static __always_inline void __ct_keep_spare(const struct kbp_tuple *t, struct kbp_ct_entry *flow)
{
	struct kbp_scratch *scratch = map_scratch();
	struct kbp_ct_entry *reply;

	if (!scratch)
		return;
	__ct_reply_key_of_forward(t, flow, &scratch->key);
	reply = map_lookup_ct(&scratch->key);
	if (!reply)
		return;
	scratch->key.dir = KBP_CT_SPARE;
	if (map_update_ct(&scratch->key, reply) == 0)
		flow->flags |= KBP_CT_F_SPARE;
}

/* ct_touch for a forward entry, which also writes the spare of a flow older than
 * KBP_CT_TOUCH_NS that has none (__ct_keep_spare). */
static __always_inline void ct_touch_forward(struct kbp_ct_entry *flow, const struct kbp_tuple *t,
					     __u64 now)
{
	if (!(flow->flags & KBP_CT_F_SPARE) && now - flow->last_seen > KBP_CT_TOUCH_NS)
		__ct_keep_spare(t, flow);
	ct_touch(flow, t, now, 0);
}

/* A reply found no reply entry (`key`, its reply key): if its flow has a spare and is
 * still live (its forward entry names this backend, and for a remapped flow this port),
 * the spare is written back as the reply entry, which is returned; NULL otherwise. A
 * reply of a connection no Service translated (a pod answering a direct connection from
 * a port some Service targets) pays this one lookup more. Uses the scratch key. */
static __always_inline struct kbp_ct_entry *__ct_reply_from_spare(struct kbp_ct_key *key)
{
	struct kbp_scratch *scratch;
	struct kbp_ct_entry *spare, *forward, *reply;

	key->dir = KBP_CT_SPARE;
	spare = map_lookup_ct(key);
	if (!spare || !(scratch = map_scratch()))
		return NULL;
	__ct_forward_key_of_reply(key, spare, &scratch->key);
	forward = map_lookup_ct(&scratch->key);
	if (!forward || forward->port != key->sport || !lb_addr_equal(forward->addr, key->saddr))
		return NULL;
	if ((spare->flags & KBP_CT_F_SPORT) && forward->nat_port != key->dport)
		return NULL;
	key->dir = KBP_CT_REPLY;
	if (map_update_ct(key, spare))
		return NULL;
	/* An `explain` dry run writes nothing, so the spare (its copy) stands in there. */
	reply = map_lookup_ct(key);
	return reply ? reply : spare;
}

/* A pod opens a connection straight to addr:port (no service: a pod IP, or a backend
 * its socket was pointed at by the socket hooks, lib/sock.h). A reply entry left by an
 * earlier translated flow with the same ports would disguise this connection's answers
 * as the frontend's (found by bench/connect.py: reused client ports then never
 * connected), so the SYN removes the reply entry its answers would match, and the
 * forward entry of that flow with it: left alone, a later SYN of the old flow's tuple
 * would reuse the forward entry (port reuse) and find no reply entry, and its answers
 * would reach the client untranslated (found by bench/connect.py switching --socket-lb
 * between sets). Looked up first: a delete takes the bucket lock even when there is
 * nothing to delete, which cost every such SYN ~40 ns (PB-1's tc miss); the lookup ~20. */
static __always_inline void ct_forget_reply_to(const struct kbp_tuple *t)
{
	struct kbp_ct_key key = {};
	struct kbp_ct_entry *reply, *forward;

	if (!ct_reply_possible(t->dport, kbp_addr_fold(t->daddr), kbp_addr_fold(t->saddr)))
		return;
	__builtin_memcpy(key.saddr, t->daddr, sizeof(key.saddr));
	__builtin_memcpy(key.daddr, t->saddr, sizeof(key.daddr));
	key.sport = t->dport;
	key.dport = t->sport;
	key.proto = t->proto;
	key.family = t->family;
	key.dir = KBP_CT_REPLY;
	reply = map_lookup_ct(&key);
	if (!reply) { /* lost alone: its spare would restore it */
		key.dir = KBP_CT_SPARE;
		reply = map_lookup_ct(&key);
		if (!reply)
			return;
	}
	/* The forward key: the client (as it sent, port remapped or not) to the frontend. */
	__builtin_memcpy(key.saddr, t->saddr, sizeof(key.saddr));
	__builtin_memcpy(key.daddr, reply->addr, sizeof(key.daddr));
	key.sport = (reply->flags & KBP_CT_F_SPORT) ? reply->nat_port : t->sport;
	key.dport = reply->port;
	key.dir = KBP_CT_FORWARD;
	forward = map_lookup_ct(&key);
	if (forward && forward->port == t->dport && lb_addr_equal(forward->addr, t->daddr))
		map_delete_ct(&key);
	__builtin_memcpy(key.saddr, t->daddr, sizeof(key.saddr));
	__builtin_memcpy(key.daddr, t->saddr, sizeof(key.daddr));
	key.sport = t->dport;
	key.dport = t->sport;
	key.dir = KBP_CT_REPLY;
	map_delete_ct(&key);
	key.dir = KBP_CT_SPARE;
	map_delete_ct(&key);
}

/* Forget the reply entry of a forward entry about to be replaced by a new selection,
 * so the old backend's late packets are no longer disguised as the frontend. */
static __always_inline void ct_forget_reply_of(const struct kbp_tuple *t,
					       const struct kbp_ct_entry *old)
{
	struct kbp_ct_key key = {};

	/* A remapped flow's port record goes with it (the new selection writes its own). */
	if (old->flags & KBP_CT_F_SPORT) {
		ct_key_of_packet(t, KBP_CT_FORWARD, &key);
		map_delete_ct_remap(&key);
	}
	__ct_reply_key_of_forward(t, old, &key);
	map_delete_ct(&key);
	if (old->flags & KBP_CT_F_SPARE) {
		key.dir = KBP_CT_SPARE;
		map_delete_ct(&key);
	}
}

/* Is a flow with these entries' flags, idle for `idle_ns`, over? Closed (TCP: a RST, or
 * FINs both ways, what the collector calls time-wait) or idle past its state's lifetime
 * in kbp_config. The states are the collector's (agent/dataplane/ebpf/conntrack.py
 * flow_state): a new flow may take such a flow's tuple over, as netfilter lets a SYN
 * take over a TIME_WAIT or CLOSE tuple. */
static __always_inline int __ct_flow_is_over(const struct kbp_config *cfg, __u8 proto,
					     __u8 forward_flags, __u8 reply_flags, __u64 idle_ns)
{
	__u8 flags = forward_flags | reply_flags;
	__u32 lifetime;

	if (proto == IPPROTO_UDP)
		lifetime = (flags & KBP_CT_F_SEEN_REPLY) ? cfg->ct_udp_stream : cfg->ct_udp;
	else if ((flags & KBP_CT_F_RST) || (forward_flags & reply_flags & KBP_CT_F_CLOSING))
		return 1;
	else if (flags & KBP_CT_F_CLOSING)
		lifetime = cfg->ct_tcp_close_wait;
	else if (flags & KBP_CT_F_SEEN_REPLY)
		lifetime = cfg->ct_tcp_established;
	else
		lifetime = cfg->ct_tcp_syn;
	return lifetime && idle_ns > (__u64)lifetime * KBP_NS_PER_SEC;
}

/* The reply entry `held` under `key` blocks a new flow: is its flow over (see
 * __ct_flow_is_over; the flow's forward entry, found from what the reply entry restores,
 * adds the other direction's flags and packets)? If so its entries are deleted (and a
 * remapped flow's port record) and 1 is returned: the key is free to take. */
static __always_inline int __ct_take_over(const struct kbp_ct_key *key,
					  const struct kbp_ct_entry *held, __u64 now)
{
	struct kbp_config *cfg = map_lookup_config();
	struct kbp_scratch *scratch = map_scratch();
	struct kbp_ct_key *fkey;
	struct kbp_ct_entry *forward;
	__u64 last = held->last_seen;
	__u8 forward_flags = 0, flags = held->flags;

	if (!cfg || !scratch)
		return 0;
	fkey = &scratch->key;
	__ct_forward_key_of_reply(key, held, fkey);
	forward = map_lookup_ct(fkey);
	if (forward) {
		forward_flags = forward->flags;
		if (forward->last_seen > last)
			last = forward->last_seen;
	}
	if (!__ct_flow_is_over(cfg, key->proto, forward_flags, flags, now > last ? now - last : 0))
		return 0;
	if (forward)
		map_delete_ct(fkey);
	if (flags & KBP_CT_F_SPORT)
		map_delete_ct_remap(fkey);
	map_delete_ct((struct kbp_ct_key *)key);
	return 1;
}

/* Create `entry` at `key` (a reply key that claims a port) unless a live flow holds it;
 * a flow that is over gives it up (__ct_take_over). The create is an insert that fails
 * on an existing key, atomic against another CPU claiming the same key; a CPU that read
 * the old entry before another took it over and claimed it could still delete the
 * newcomer, a window of a few instructions that is accepted. 0 when created. */
static __always_inline int __ct_claim(struct kbp_ct_key *key, struct kbp_ct_entry *entry,
				      __u64 now)
{
	struct kbp_ct_entry *held;

	if (map_insert_ct(key, entry) == 0)
		return 0;
	held = map_lookup_ct(key);
	if (held && !__ct_take_over(key, held, now))
		return -1;
	return map_insert_ct(key, entry);
}

/* Tries at a free SNAT port before the flow is refused (KBP_DROP_NO_SNAT_PORT). */
#define KBP_SNAT_TRIES 16

/* Is the reply entry `held`, found under the reply key of a new flow to frontend
 * t->daddr:t->dport, another flow's? It restores another frontend (the same client port
 * went to two frontends that share this backend), or it is a remapped flow's, whose
 * port this one happens to use. Otherwise it is this tuple's earlier flow. */
static __always_inline int __ct_reply_is_other_flow(const struct kbp_ct_entry *held,
						    const struct kbp_tuple *t)
{
	return (held->flags & KBP_CT_F_SPORT) || held->port != t->dport ||
	       !lb_addr_equal(held->addr, t->daddr);
}

/* Claim a port of the SNAT range for a clashing flow's reply entry (key->dport), the
 * client's address kept: first `want` (a lost flow's recorded port, kbp_ct_remap), else
 * one derived from the flow hash, then random ones. A port held by another flow is
 * skipped even when that flow is over (the take-over of __ct_claim, inlined a third time,
 * overflowed the external path's stack); the collector frees such ports. `entry` is the
 * reply entry, already marked KBP_CT_F_SPORT. 0 on success. */
static __always_inline int __ct_claim_client_port(const struct kbp_tuple *t,
						  struct kbp_ct_key *key,
						  struct kbp_ct_entry *entry, __be16 want)
{
	struct kbp_config *cfg = map_lookup_config();
	__u32 span;

	if (!cfg || cfg->snat_port_min == 0 || cfg->snat_port_max < cfg->snat_port_min)
		return -1;
	span = (__u32)cfg->snat_port_max - cfg->snat_port_min + 1;
	key->dport = want ? want : bpf_htons((__u16)(cfg->snat_port_min + lb_flow_hash(t) % span));
	for (int i = 0; i < KBP_SNAT_TRIES; i++) {
		if (map_insert_ct(key, entry) == 0)
			return 0;
		key->dport = bpf_htons((__u16)(cfg->snat_port_min + bpf_get_prandom_u32() % span));
	}
	return -1;
}

/* The port a lost flow (ct_note_lost) was remapped to, from its kbp_ct_remap record
 * (network order), or 0: not remapped, or not lost. */
static __always_inline __be16 __ct_remapped_port(const struct kbp_tuple *t, int lost)
{
	struct kbp_scratch *scratch;
	struct kbp_ct_remap *record;

	if (!lost || !(scratch = map_scratch()))
		return 0;
	ct_key_of_packet(t, KBP_CT_FORWARD, &scratch->key);
	scratch->key.pad = 0;
	record = map_lookup_ct_remap(&scratch->key);
	return record ? record->port : 0;
}

/* Note a remapped flow's port by its forward key, so ct_create finds it again when the
 * flow's entries are lost. Best effort: without it such a flow is reset when lost. */
static __always_inline void __ct_record_remap(struct kbp_ct_key *forward_key, __be16 port)
{
	struct kbp_scratch *scratch = map_scratch();
	struct kbp_ct_remap *record;

	if (!scratch)
		return;
	record = (struct kbp_ct_remap *)&scratch->key; /* the key is not needed here */
	__builtin_memset(record, 0, sizeof(*record));
	record->port = port;
	map_update_ct_remap(forward_key, record);
}

/* Record a new flow to `backend`: reply entry (frontend to restore) and forward entry
 * (backend to use). The reply entry is created only where no other flow holds its key:
 * a live flow of another frontend there (a clash) keeps it, and this flow's source port
 * is remapped (KBP_CT_F_SPORT, the port recorded in kbp_ct_remap); an entry of the same
 * frontend is this tuple's earlier flow, and one of a flow that is over is taken over.
 * `lost` (ct_note_lost): the flow lost its entries; if a clash had remapped it, the port
 * kbp_ct_remap recorded is used again whether or not the clash still exists, since the
 * backend knows the flow by it. `clash`: the caller knows the client's own port is taken
 * at the backend by a flow kbp_ct does not hold (a socket the socket hooks translated), so
 * the port is remapped at once. *sport is the source port to send the packet with
 * (network order). Returns 0, or -1 when the map refused an entry or no port was free. */
static __always_inline int __ct_create(const struct kbp_tuple *t, const struct kbp_service *svc,
				       __u32 backend_id, const struct kbp_backend *backend,
				       int hairpin, __u64 now, int lost, int clash, __be16 *sport)
{
	struct kbp_ct_key key = {};
	struct kbp_ct_entry stored = {}, *entry = &stored;
	struct kbp_ct_entry *held;
	__be16 remapped = hairpin ? 0 : __ct_remapped_port(t, lost);

	entry->backend_id = backend_id;
	entry->service_id = svc->service_id;
	entry->flags = hairpin ? KBP_CT_F_HAIRPIN : 0;
	if (!hairpin && (svc->flags & KBP_SVC_F_EXTERNAL))
		entry->flags |= KBP_CT_F_REPLY_AT_CLIENT;
	entry->last_seen = now;
	*sport = t->sport;

	__ct_reply_key(t, backend->addr, backend->port, hairpin, &key);
	__builtin_memcpy(entry->addr, t->daddr, sizeof(entry->addr));
	entry->port = t->dport;
	if (remapped || clash || map_insert_ct(&key, entry)) {
		held = remapped || clash ? NULL : map_lookup_ct(&key);
		if (!remapped && !clash &&
		    (hairpin || !held || !__ct_reply_is_other_flow(held, t) ||
		     __ct_take_over(&key, held, now))) {
			if (map_update_ct(&key, entry))
				return -1;
		} else {
			entry->flags |= KBP_CT_F_SPORT;
			__builtin_memcpy(entry->nat_addr, t->saddr, sizeof(entry->nat_addr));
			entry->nat_port = t->sport;
			if (__ct_claim_client_port(t, &key, entry, remapped))
				return -1;
			*sport = key.dport;
			entry->nat_port = key.dport; /* the forward entry's: the port sent with */
			ct_count(KBP_CT_STAT_REMAPPED);
		}
	}

	ct_key_of_packet(t, KBP_CT_FORWARD, &key);
	__builtin_memcpy(entry->addr, backend->addr, sizeof(entry->addr));
	entry->port = backend->port;
	if (map_update_ct(&key, entry))
		return -1;
	if (entry->flags & KBP_CT_F_SPORT)
		__ct_record_remap(&key, entry->nat_port);
	return 0;
}

/* A new flow tc translates (see __ct_create). */
static __always_inline int ct_create(const struct kbp_tuple *t, const struct kbp_service *svc,
				     __u32 backend_id, const struct kbp_backend *backend,
				     int hairpin, __u64 now, int lost, __be16 *sport)
{
	return __ct_create(t, svc, backend_id, backend, hairpin, now, lost, 0, sport);
}

/* A new flow whose client port a socket of the client already uses towards `backend`
 * (the socket hooks leave it to tc, which must remap it: lib/sock.h). */
static __always_inline int ct_create_clashing(const struct kbp_tuple *t,
					      const struct kbp_service *svc, __u32 backend_id,
					      const struct kbp_backend *backend, __u64 now)
{
	__be16 sport;

	return __ct_create(t, svc, backend_id, backend, 0, now, 0, 1, &sport);
}

/* Record a new flow from outside to a backend on another node, with its source rewritten
 * to `snat_addr` and a free port of the range. The port is claimed by creating the reply
 * entry (backend -> snat_addr:port) only if no flow holds it (BPF_NOEXIST), which is
 * atomic across CPUs; the first try is derived from the client's address and port, so a
 * client's retransmitted SYN on another CPU tends to land on the same port, then random
 * ports follow. Returns the port (network order) in *snat_port, or -1 when every try
 * was taken or the map refused the forward entry. */
static __always_inline int ct_create_snat(const struct kbp_tuple *t, const struct kbp_service *svc,
					  __u32 backend_id, const struct kbp_backend *backend,
					  const __be32 *snat_addr, __u16 port_min, __u16 port_max,
					  __u64 now, __be16 *snat_port)
{
	struct kbp_ct_key key = {};
	struct kbp_scratch *scratch = map_scratch();
	struct kbp_ct_entry *entry;
	__u32 span = (__u32)port_max - port_min + 1;
	__u32 candidate = lb_flow_hash(t);
	int claimed = 0;

	if (port_max < port_min || !scratch)
		return -1;
	entry = &scratch->entry;
	__builtin_memset(entry, 0, sizeof(*entry));
	entry->backend_id = backend_id;
	entry->service_id = svc->service_id;
	entry->flags = KBP_CT_F_SNAT;
	entry->last_seen = now;
	/* Reply entry: backend -> snat address; restores frontend (source) and client. */
	__builtin_memcpy(key.saddr, backend->addr, sizeof(key.saddr));
	__builtin_memcpy(key.daddr, snat_addr, sizeof(key.daddr));
	key.sport = backend->port;
	key.proto = t->proto;
	key.family = t->family;
	key.dir = KBP_CT_REPLY;
	__builtin_memcpy(entry->addr, t->daddr, sizeof(entry->addr));
	entry->port = t->dport;
	__builtin_memcpy(entry->nat_addr, t->saddr, sizeof(entry->nat_addr));
	entry->nat_port = t->sport;
	for (int i = 0; i < KBP_SNAT_TRIES; i++) {
		key.dport = bpf_htons((__u16)(port_min + candidate % span));
		if (__ct_claim(&key, entry, now) == 0) {
			claimed = 1;
			break;
		}
		candidate = bpf_get_prandom_u32();
	}
	if (!claimed)
		return -1;
	*snat_port = key.dport;

	/* The forward entry reuses the key's stack slot (the stack is 512 bytes, and this is
	 * inlined into the whole external path); the reply key is rebuilt to undo. */
	ct_key_of_packet(t, KBP_CT_FORWARD, &key);
	__builtin_memcpy(entry->addr, backend->addr, sizeof(entry->addr));
	entry->port = backend->port;
	__builtin_memcpy(entry->nat_addr, snat_addr, sizeof(entry->nat_addr));
	entry->nat_port = *snat_port;
	if (map_update_ct(&key, entry) == 0)
		return 0;
	__builtin_memcpy(key.saddr, backend->addr, sizeof(key.saddr));
	__builtin_memcpy(key.daddr, snat_addr, sizeof(key.daddr));
	key.sport = backend->port;
	key.dport = *snat_port;
	key.dir = KBP_CT_REPLY;
	map_delete_ct(&key); /* give the port back */
	return -1;
}

#endif /* KBP_LIB_CONNTRACK_H */
