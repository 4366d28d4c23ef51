/* SPDX-License-Identifier: Apache-2.0 */
/*
 * XDP on the node's external interfaces: what can be decided before the stack is. New
 * and established flows to backends on other nodes are rewritten (DNAT + SNAT) and sent
 * back out with the FIB's next hop (XDP_TX on the same interface, XDP_REDIRECT to
 * another), and so are their replies; source-range refusals and empty sets with
 * endpoints elsewhere are dropped. Everything else passes to tc, which decides from the
 * same conntrack: local backends (delivery needs the stack), REJECTs (tc builds the
 * RST), and flows whose next hop has no resolved neighbour yet, left untouched here.
 *
 * The frame is rewritten only once the FIB lookup has succeeded, so a packet passed on
 * is always the one that arrived. Checksums are updated in place assuming complete L4
 * checksums, which is what a NIC delivers (nat_rewrite_frame).
 */
#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/counters.h"
#include "lib/ext.h"
#include "lib/lb.h"
#include "lib/nat.h"
#include "lib/parse.h"

static __always_inline int __xdp_verdict(__u32 verdict, __u32 bytes, int action)
{
	struct kbp_drop_counters *c = map_lookup_xdp_stats(&verdict);

	if (c) {
		c->packets += 1;
		c->bytes += bytes;
	}
	return action;
}

/* Forward the frame rewritten to `to`, or pass it untouched when no next hop with a MAC
 * address is known now (tc will do the forwarding then). `flow` is the conntrack entry
 * whose next hop is reused (NULL for a new flow). */
static __always_inline int __xdp_forward(struct xdp_md *ctx, const struct kbp_tuple *t,
					 const struct kbp_nat_target *to,
					 struct kbp_ct_entry *flow, __u32 service_id, __u64 now)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 bytes = data_end - data;
	struct bpf_fib_lookup fib = {};

	/* An expiring hop is tc's to count and drop, as every packet XDP cannot forward. */
	if (nat_hop_expires(data, data_end, t->family))
		return __xdp_verdict(KBP_XDP_PASS, bytes, XDP_PASS);
	if (ext_next_hop(ctx, t, to, ctx->ingress_ifindex, flow, now, &fib) !=
	    BPF_FIB_LKUP_RET_SUCCESS)
		return __xdp_verdict(KBP_XDP_PASS, bytes, XDP_PASS);
	if (nat_rewrite_frame(data, data_end, t, to) ||
	    nat_decrement_hop(data, data_end, t->family) || ext_set_macs(data, data_end, &fib)) {
		count_drop(KBP_DROP_NAT_FAILED, bytes);
		return __xdp_verdict(KBP_XDP_DROP_OTHER, bytes, XDP_DROP);
	}
	count_service_packet(service_id, bytes);
	if (fib.ifindex == ctx->ingress_ifindex)
		return __xdp_verdict(KBP_XDP_TX, bytes, XDP_TX);
	return __xdp_verdict(KBP_XDP_REDIRECT, bytes, bpf_redirect(fib.ifindex, 0));
}

int kbp_xdp_ext(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 bytes = data_end - data;
	struct kbp_ext_verdict v = {};
	struct kbp_ct_entry *reply;
	struct kbp_config *cfg;
	struct kbp_tuple t = {};
	int decided;
	__u64 now;

	if (parse_frame(data, data_end, &t) != KBP_PARSE_L4)
		return __xdp_verdict(KBP_XDP_PASS, bytes, XDP_PASS);
	cfg = map_lookup_config();
	if (!cfg)
		return __xdp_verdict(KBP_XDP_PASS, bytes, XDP_PASS);
	now = kbp_now();
	reply = ext_snat_reply(&t, cfg, now);
	if (reply) {
		nat_target_snat_reply(reply, &v.to);
		return __xdp_forward(ctx, &t, &v.to, reply, reply->service_id, now);
	}
	decided = ext_decide(&t, cfg, now, &v);
	if (decided == KBP_EXT_FORWARD)
		return __xdp_forward(ctx, &t, &v.to, v.flow, v.service_id, now);
	if (decided == KBP_EXT_DROP) {
		count_service_drop(v.service_id, v.reason, bytes);
		if (v.reason == KBP_DROP_SOURCE_RANGE)
			return __xdp_verdict(KBP_XDP_DROP_RANGE, bytes, XDP_DROP);
		if (v.reason == KBP_DROP_NO_BACKEND)
			return __xdp_verdict(KBP_XDP_DROP_NO_BACKEND, bytes, XDP_DROP);
		return __xdp_verdict(KBP_XDP_DROP_OTHER, bytes, XDP_DROP);
	}
	/* KBP_EXT_LOCAL (conntrack now holds the flow; tc rewrites it), KBP_EXT_REJECT and
	 * KBP_EXT_NONE. */
	return __xdp_verdict(KBP_XDP_PASS, bytes, XDP_PASS);
}
