/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The external path: packets that reach the node on an external interface (from outside
 * the cluster, or from pods on other nodes) for one of its frontends, and the replies of
 * flows translated here. The decision (conntrack, source ranges, backend set, selection,
 * SNAT port) is shared by the XDP and tc programs; each applies it with its own means.
 *
 * A backend on this node gets the packet with only the destination rewritten: the
 * client's address reaches the pod, and the pod's reply is translated back at this
 * interface's egress (KBP_CT_F_REPLY_AT_CLIENT). A backend on another node would answer
 * the client directly, so the source is rewritten to this node's address and a port of
 * the SNAT range, and the packet is forwarded to the next hop found in the FIB; its
 * reply comes back here and is translated at ingress and forwarded to the client.
 */
#ifndef KBP_LIB_EXT_H
#define KBP_LIB_EXT_H

#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/counters.h"
#include "lib/lb.h"
#include "lib/nat.h"
#include "lib/parse.h"

/* What ext_decide found for a packet to a frontend. */
#define KBP_EXT_LOCAL 0   /* rewrite the destination; the stack delivers to the local pod */
#define KBP_EXT_FORWARD 1 /* rewrite both ends and forward to a backend on another node */
#define KBP_EXT_DROP 2    /* drop, for `reason` (KBP_DROP_*) */
#define KBP_EXT_REJECT 3  /* the set is empty and no endpoint exists: RST / ICMP */
#define KBP_EXT_NONE 4    /* not for a frontend: not ours, the packet passes */

/* How long a flow reuses the next hop its conntrack entry remembers before asking the
 * FIB again. A FIB lookup costs about as much as the rest of the forwarding path together
 * (bench/datapath.py: ~200 ns of ~450 here), so a forwarded flow asks at most this often;
 * a route or neighbour change reaches established flows within this time. */
#define KBP_HOP_CACHE_NS (100ULL * 1000 * 1000)

/* How long a next hop cached by address (kbp_hops) holds while the agent watches routes
 * and neighbours (kbp_hop_epoch not 0): it changes the epoch on every change that could
 * change an answer, so this bound only matters when the agent is gone without saying so
 * (killed), as the staleness it leaves behind. */
#define KBP_HOP_WATCHED_NS (10ULL * 1000 * 1000 * 1000)

struct kbp_ext_verdict {
	struct kbp_nat_target to; /* the packet's new tuple (LOCAL, FORWARD) */
	const struct kbp_service *svc; /* the frontend (REJECT builds its answer from it) */
	struct kbp_ct_entry *flow; /* the flow's forward entry, NULL for a new flow */
	__u32 service_id;
	__u32 reason; /* KBP_DROP_* for KBP_EXT_DROP */
};

/* The source address of SNATed flows of the packet's family, or NULL when the agent has
 * not configured one (no node address of that family). */
static __always_inline const __be32 *ext_snat_addr(const struct kbp_config *cfg, __u8 family)
{
	const __be32 *addr = family == KBP_FAMILY_IPV4 ? cfg->node_addr4 : cfg->node_addr6;

	if ((addr[0] | addr[1] | addr[2] | addr[3]) == 0)
		return NULL;
	return addr;
}

static __always_inline void __ext_target(const struct kbp_tuple *t, const struct kbp_ct_entry *flow,
					 struct kbp_ext_verdict *v)
{
	nat_target_of_packet(t, &v->to);
	/* A remapped client port (KBP_CT_F_SPORT) is a SNAT that keeps the client address:
	 * the forward entry's nat_addr is the client's own. */
	if (flow->flags & (KBP_CT_F_SNAT | KBP_CT_F_SPORT)) {
		nat_target_snat(t, flow, &v->to);
	} else {
		__builtin_memcpy(v->to.daddr, flow->addr, sizeof(v->to.daddr));
		v->to.dport = flow->port;
	}
}

/* A new flow: source ranges, the set for this client, selection, and conntrack (with a
 * SNAT port when the backend is on another node). `lost`: see ct_create. */
static __always_inline int __ext_new_flow(const struct kbp_tuple *t, const struct kbp_service *svc,
					  const struct kbp_config *cfg, struct kbp_ct_entry *stale,
					  int lost, __u64 now, struct kbp_ext_verdict *v)
{
	struct kbp_backend *backend;
	struct kbp_ct_entry *flow;
	const __be32 *snat_addr;
	__u32 backend_id = 0, set_id, count;
	__be16 snat_port;

	if (!lb_source_admitted(t, svc)) {
		v->reason = KBP_DROP_SOURCE_RANGE;
		return KBP_EXT_DROP;
	}
	/* Pods of the cluster use the set for pods, everyone else the set from outside; a
	 * ClusterIP (reached from outside when a router sends the Service range here) has
	 * the same set in both (the agent writes them so). */
	if (lb_from_cluster_pod(t, cfg))
		lb_set_for_pods(svc, &set_id, &count);
	else
		lb_set_for_outside(svc, &set_id, &count);
	if (count == 0) {
		v->reason = KBP_DROP_NO_BACKEND;
		return (svc->flags & KBP_SVC_F_HAS_ENDPOINTS) ? KBP_EXT_DROP : KBP_EXT_REJECT;
	}
	backend = lb_select_backend(t, svc, set_id, count, now, &backend_id);
	if (!backend) {
		v->reason = KBP_DROP_BACKEND_GONE;
		return KBP_EXT_DROP;
	}
	if (backend->family != t->family) {
		v->reason = KBP_DROP_NAT_FAILED;
		return KBP_EXT_DROP;
	}
	if (stale)
		ct_forget_reply_of(t, stale);
	nat_target_of_packet(t, &v->to);
	__builtin_memcpy(v->to.daddr, backend->addr, sizeof(v->to.daddr));
	v->to.dport = backend->port;
	if (backend->flags & KBP_BE_F_LOCAL) {
		if (ct_create(t, svc, backend_id, backend, 0, now, lost, &snat_port)) {
			v->reason = KBP_DROP_NAT_FAILED;
			return KBP_EXT_DROP;
		}
		v->to.sport = snat_port;
	} else {
		snat_addr = ext_snat_addr(cfg, t->family);
		if (!snat_addr) {
			v->reason = KBP_DROP_NO_ROUTE;
			return KBP_EXT_DROP;
		}
		if (ct_create_snat(t, svc, backend_id, backend, snat_addr, cfg->snat_port_min,
				   cfg->snat_port_max, now, &snat_port)) {
			v->reason = KBP_DROP_NO_SNAT_PORT;
			return KBP_EXT_DROP;
		}
		__builtin_memcpy(v->to.saddr, snat_addr, sizeof(v->to.saddr));
		v->to.sport = snat_port;
	}
	lb_remember_affinity(t, svc, now, backend_id);
	count_new_flow(svc->service_id);
	return (backend->flags & KBP_BE_F_LOCAL) ? KBP_EXT_LOCAL : KBP_EXT_FORWARD;
}

/* A packet from an external interface that is not a SNATed flow's reply: KBP_EXT_NONE
 * when it is not for a frontend (the node's own traffic, the common case, costs this one
 * lookup); else keep the flow's backend from conntrack when still usable, or decide as a
 * new flow. */
static __always_inline int ext_decide(const struct kbp_tuple *t, const struct kbp_config *cfg,
				      __u64 now, struct kbp_ext_verdict *v)
{
	struct kbp_service *svc = lb_lookup_service(t);
	struct kbp_ct_entry *flow;
	int lost;

	if (!svc)
		return KBP_EXT_NONE;
	v->svc = svc;
	v->service_id = svc->service_id;
	flow = ct_lookup_forward(t);
	/* A flow netfilter translated (lib/conntrack.h ct_left_to_netfilter; not touched
	 * here, as below: the agent deletes the entry when netfilter's is gone). */
	if (flow && flow->backend_id == KBP_CT_NETFILTER && !tuple_is_tcp_syn(t))
		return KBP_EXT_NONE;
	if (flow && ct_forward_is_usable(flow, svc, t)) {
		v->flow = flow;
		/* not ct_touch_forward: its spare overflows kbp_from_ext's stack */
		ct_touch(flow, t, now, 0);
		__ext_target(t, flow, v);
		return (flow->flags & KBP_CT_F_SNAT) ? KBP_EXT_FORWARD : KBP_EXT_LOCAL;
	}
	lost = ct_note_lost(t, flow);
	if (lost && cfg->handoff)
		return KBP_EXT_NONE; /* a flow netfilter translated, at a takeover */
	return __ext_new_flow(t, svc, cfg, flow, lost, now, v);
}

/* A reply arriving on an external interface: only SNATed flows are translated here
 * (their replies come back to this node's address, at a port of the SNAT range, so other
 * packets skip the lookup); the others' replies travel on to the client's hook. NULL
 * when the packet is not such a reply. */
static __always_inline struct kbp_ct_entry *ext_snat_reply(const struct kbp_tuple *t,
							   const struct kbp_config *cfg, __u64 now)
{
	__u16 port = bpf_ntohs(t->dport);
	struct kbp_ct_entry *reply;

	if (port < cfg->snat_port_min || port > cfg->snat_port_max)
		return NULL;
	reply = __ct_lookup_reply(t, 0);
	if (!reply || !(reply->flags & KBP_CT_F_SNAT))
		return NULL;
	ct_touch(reply, t, now, KBP_CT_F_SEEN_REPLY);
	return reply;
}

/* FIB parameters for forwarding a packet rewritten to `to`, looked up as if it arrived
 * on `ifindex`. */
static __always_inline void ext_fib_params(const struct kbp_tuple *t,
					   const struct kbp_nat_target *to, __u32 ifindex,
					   struct bpf_fib_lookup *fib)
{
	fib->ifindex = ifindex;
	fib->l4_protocol = t->proto;
	fib->sport = to->sport;
	fib->dport = to->dport;
	if (t->family == KBP_FAMILY_IPV4) {
		fib->family = KBP_AF_INET;
		fib->ipv4_src = to->saddr[0];
		fib->ipv4_dst = to->daddr[0];
	} else {
		fib->family = KBP_AF_INET6;
		__builtin_memcpy(fib->ipv6_src, to->saddr, 16);
		__builtin_memcpy(fib->ipv6_dst, to->daddr, 16);
	}
}

/* A next hop remembered by a flow, when younger than KBP_HOP_CACHE_NS: fib->ifindex,
 * smac and dmac set, 1; else 0. */
static __always_inline int __ext_hop_fresh(__u64 time, __u32 out_ifindex, const __u8 *smac,
					   const __u8 *dmac, __u64 now,
					   struct bpf_fib_lookup *fib)
{
	if (!time || now - time >= KBP_HOP_CACHE_NS)
		return 0;
	fib->ifindex = out_ifindex;
	__builtin_memcpy(fib->smac, smac, ETH_ALEN);
	__builtin_memcpy(fib->dmac, dmac, ETH_ALEN);
	return 1;
}

/* Does a cached next hop (kbp_hops) answer for `addr` arriving on `ifindex` now: the
 * same address and interface, found under the current epoch and younger than
 * KBP_HOP_WATCHED_NS, or, with no epoch (nobody watches), younger than KBP_HOP_CACHE_NS. */
static __always_inline int __ext_hop_current(const struct kbp_hop *hop, const __be32 *addr,
					     __u32 ifindex, __u32 epoch, __u64 now)
{
	if (!hop->time || hop->in_ifindex != ifindex || !lb_addr_equal(hop->addr, addr))
		return 0;
	if (epoch)
		return hop->epoch == epoch && now - hop->time < KBP_HOP_WATCHED_NS;
	return now - hop->time < KBP_HOP_CACHE_NS;
}

/* The next hop of a packet rewritten to `to`, as if it arrived on `ifindex`: the one the
 * flow's conntrack entry remembers while younger than KBP_HOP_CACHE_NS, else the one
 * kbp_hops holds for the destination address (__ext_hop_current); else the FIB's, which a
 * successful lookup leaves in both (`flow` NULL: a new flow). So a new flow to a backend
 * that an earlier flow reached skips the FIB lookup (about as costly as the rest of its
 * path; bench/datapath.py): for as long as no route, rule, link or neighbour changed
 * while the agent watches (it changes kbp_hop_epoch), else for KBP_HOP_CACHE_NS. A
 * change reaches established flows within KBP_HOP_CACHE_NS. With equal-cost routes the
 * flows to one address follow one path while its answer holds. Returns
 * BPF_FIB_LKUP_RET_*, with fib->ifindex, smac and dmac set on success. Entries are shared
 * by all CPUs: two CPUs refreshing one at once write the same answer. */
static __always_inline int ext_next_hop(void *ctx, const struct kbp_tuple *t,
					const struct kbp_nat_target *to, __u32 ifindex,
					struct kbp_ct_entry *flow, __u64 now,
					struct bpf_fib_lookup *fib)
{
	struct kbp_hop *hop;
	__u32 epoch;
	int rc;

	if (flow && __ext_hop_fresh(flow->hop_time, flow->hop_ifindex, flow->hop_smac,
				    flow->hop_dmac, now, fib))
		return BPF_FIB_LKUP_RET_SUCCESS;
	epoch = map_hop_epoch();
	hop = map_hop(to->daddr);
	if (hop && __ext_hop_current(hop, to->daddr, ifindex, epoch, now)) {
		fib->ifindex = hop->ifindex;
		__builtin_memcpy(fib->smac, hop->smac, ETH_ALEN);
		__builtin_memcpy(fib->dmac, hop->dmac, ETH_ALEN);
		rc = BPF_FIB_LKUP_RET_SUCCESS;
	} else {
		ext_fib_params(t, to, ifindex, fib);
		rc = bpf_fib_lookup(ctx, fib, sizeof(*fib), 0);
		if (rc != BPF_FIB_LKUP_RET_SUCCESS)
			return rc;
		if (hop) {
			hop->time = 0; /* a reader in between sees no answer, not half of one */
			__builtin_memcpy(hop->addr, to->daddr, sizeof(hop->addr));
			hop->in_ifindex = ifindex;
			hop->ifindex = fib->ifindex;
			__builtin_memcpy(hop->smac, fib->smac, ETH_ALEN);
			__builtin_memcpy(hop->dmac, fib->dmac, ETH_ALEN);
			hop->epoch = epoch;
			hop->time = now;
		}
	}
	if (flow) {
		flow->hop_ifindex = fib->ifindex;
		__builtin_memcpy(flow->hop_smac, fib->smac, ETH_ALEN);
		__builtin_memcpy(flow->hop_dmac, fib->dmac, ETH_ALEN);
		flow->hop_time = now;
	}
	return rc;
}

/* The next hop's and our MAC addresses from a successful next-hop lookup, written into a
 * frame (XDP). */
static __always_inline int ext_set_macs(void *data, void *data_end,
					const struct bpf_fib_lookup *fib)
{
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return -1;
	__builtin_memcpy(eth->h_dest, fib->dmac, ETH_ALEN);
	__builtin_memcpy(eth->h_source, fib->smac, ETH_ALEN);
	return 0;
}

/* The same into an skb (tc), through the helper: a direct write would cost every packet
 * of the program an unclone (lib/nat.h). */
static __always_inline int ext_set_macs_skb(struct __sk_buff *skb,
					    const struct bpf_fib_lookup *fib)
{
	__u8 macs[2 * ETH_ALEN];

	__builtin_memcpy(macs, fib->dmac, ETH_ALEN);
	__builtin_memcpy(macs + ETH_ALEN, fib->smac, ETH_ALEN);
	return bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0) ? -1 : 0;
}

#endif /* KBP_LIB_EXT_H */
