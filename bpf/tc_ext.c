/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tc on the node's external interfaces (--external-interfaces). Ingress: packets to a
 * frontend are translated (lib/ext.h) and, for backends on other nodes, forwarded with
 * their FIB next hop; replies of SNATed flows are translated back and forwarded to the
 * client. Egress: replies of local backends to clients outside get the frontend back as
 * their source. The XDP program on the same interface may have done the ingress work
 * already; what it passed on arrives here and is decided from the same conntrack.
 */
#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/ext.h"
#include "lib/lb.h"
#include "lib/nat.h"
#include "lib/parse.h"
#include "lib/translate.h"

/* bcc 0.26 declares bpf_redirect_neigh with three arguments; the kernel's (5.11+) takes
 * ifindex, params, plen, flags, so declare it as the kernel defines it. */
#define __kbp_redirect_neigh \
	((long (*)(__u32, void *, int, __u64))BPF_FUNC_redirect_neigh)

/* Send a rewritten packet to its next hop: straight to the neighbour when its MAC address
 * is known (lib/ext.h ext_next_hop), else through the neighbour subsystem, which resolves
 * it (kernel 5.10+). Bypassing the stack also spares the packet the input route check,
 * which would drop a forwarded packet whose source is this node's own address as
 * martian. `flow` is the conntrack entry whose next hop is reused (NULL: a new flow). */
static __always_inline int __ext_tc_forward(struct __sk_buff *skb, const struct kbp_tuple *t,
					    const struct kbp_nat_target *to,
					    struct kbp_ct_entry *flow, __u32 service_id,
					    __u64 now)
{
	struct bpf_fib_lookup fib = {};
	int rc;

	if (nat_decrement_hop_skb(skb, t->family))
		return drop_service_packet(skb->len, service_id, KBP_DROP_NO_ROUTE);
	rc = ext_next_hop(skb, t, to, skb->ingress_ifindex, flow, now, &fib);
	if (rc == BPF_FIB_LKUP_RET_SUCCESS) {
		if (ext_set_macs_skb(skb, &fib))
			return drop_service_packet(skb->len, service_id, KBP_DROP_MALFORMED);
		return bpf_redirect(fib.ifindex, 0);
	}
	if (rc == BPF_FIB_LKUP_RET_NO_NEIGH)
		return __kbp_redirect_neigh(fib.ifindex, NULL, 0, 0);
	return drop_service_packet(skb->len, service_id, KBP_DROP_NO_ROUTE);
}

static __always_inline int __kbp_from_ext(struct __sk_buff *skb)
{
	struct kbp_ext_verdict v = {};
	struct kbp_ct_entry *reply;
	struct kbp_config *cfg;
	struct kbp_tuple t = {};
	__u32 bytes = skb->len;
	int decided;
	__u64 now;

	/* Not ours to police: the node's own traffic crosses this hook too. */
	if (parse_packet(skb, &t) != KBP_PARSE_L4)
		return TC_ACT_OK;
	cfg = map_lookup_config();
	if (!cfg)
		return TC_ACT_OK;
	now = kbp_now();
	reply = ext_snat_reply(&t, cfg, now);
	if (reply) {
		nat_target_snat_reply(reply, &v.to);
		if (nat_rewrite(skb, &t, &v.to))
			return drop_service_packet(bytes, reply->service_id, KBP_DROP_NAT_FAILED);
		count_service_packet(reply->service_id, bytes);
		return __ext_tc_forward(skb, &t, &v.to, reply, reply->service_id, now);
	}
	decided = ext_decide(&t, cfg, now, &v);
	if (decided == KBP_EXT_NONE)
		return TC_ACT_OK;
	if (decided == KBP_EXT_DROP)
		return drop_service_packet(bytes, v.service_id, v.reason);
	if (decided == KBP_EXT_REJECT)
		return translate_to_empty_set(skb, &t, v.svc);
	if (nat_rewrite(skb, &t, &v.to))
		return drop_service_packet(bytes, v.service_id, KBP_DROP_NAT_FAILED);
	count_service_packet(v.service_id, bytes);
	if (decided == KBP_EXT_LOCAL)
		return TC_ACT_OK;
	return __ext_tc_forward(skb, &t, &v.to, v.flow, v.service_id, now);
}

int kbp_to_ext(struct __sk_buff *skb)
{
	struct kbp_ct_entry *reply;
	struct kbp_tuple t = {};

	if (parse_packet(skb, &t) != KBP_PARSE_L4)
		return TC_ACT_OK;
	reply = ct_lookup_reply(&t);
	/* SNATed flows' replies arrive at ingress; the rest are pods' flows whose replies
	 * leave through here (a local backend answering a client outside). */
	if (!reply || (reply->flags & KBP_CT_F_SNAT))
		return TC_ACT_OK;
	return translate_reply(skb, &t, reply, 0);
}

/* The entry (`explain` runs its own build of it: lib/maps.h). */
int kbp_from_ext(struct __sk_buff *skb)
{
	return __kbp_from_ext(skb);
}
