/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The policy the hooks share, built from the smaller libraries: translate a packet to a
 * service frontend (conntrack, selection, DNAT, hairpin, REJECT/DROP for empty sets) and
 * reverse-translate a backend's reply.
 */
#ifndef KBP_LIB_TRANSLATE_H
#define KBP_LIB_TRANSLATE_H

#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/counters.h"
#include "lib/lb.h"
#include "lib/nat.h"
#include "lib/parse.h"
#include "lib/reject.h"

static __always_inline int drop_packet(__u32 bytes, __u32 reason)
{
	count_drop(reason, bytes);
	return TC_ACT_SHOT;
}

static __always_inline int drop_service_packet(__u32 bytes, __u32 service_id, __u32 reason)
{
	count_service_drop(service_id, reason, bytes);
	return TC_ACT_SHOT;
}

/* A backend's reply (or, for hairpin, the pod answering itself): restore the frontend
 * as its source. `may_redirect`: the hook is the pod's ingress, where a hairpin reply
 * must be turned around to the same pod. */
static __always_inline int translate_reply(struct __sk_buff *skb, const struct kbp_tuple *t,
					   struct kbp_ct_entry *entry, int may_redirect)
{
	__u32 bytes = skb->len;
	__u32 service_id = entry->service_id;
	int hairpin = entry->flags & KBP_CT_F_HAIRPIN;

	/* At the backend's ingress a node-address frontend is left for the client's egress
	 * (KBP_CT_F_REPLY_AT_CLIENT); the untranslated reply is routed there like any
	 * pod-to-pod packet. */
	if (may_redirect && (entry->flags & KBP_CT_F_REPLY_AT_CLIENT))
		return TC_ACT_OK;
	ct_touch(entry, t, kbp_now(), KBP_CT_F_SEEN_REPLY);
	if (nat_reverse_reply(skb, t, entry))
		return drop_service_packet(bytes, service_id, KBP_DROP_NAT_FAILED);
	count_service_packet(service_id, bytes);
	if (hairpin && may_redirect)
		return nat_redirect_back(skb);
	return TC_ACT_OK;
}

/* A new flow to a service whose set is empty: DROP when endpoints exist elsewhere
 * (hasEndpoints, e.g. Local policy), else REJECT like kube-proxy. */
static __always_inline int translate_to_empty_set(struct __sk_buff *skb, const struct kbp_tuple *t,
						  const struct kbp_service *svc)
{
	__u32 bytes = skb->len;
	__u32 service_id = svc->service_id;
	int built;

	if (svc->flags & KBP_SVC_F_HAS_ENDPOINTS)
		return drop_service_packet(bytes, service_id, KBP_DROP_NO_BACKEND);
	built = reject_packet(skb, t);
	if (built < 0)
		return drop_service_packet(bytes, service_id, KBP_DROP_REJECT_FAILED);
	count_service_drop(service_id, KBP_DROP_REJECTED, bytes);
	if (built == KBP_REJECT_SILENT)
		return TC_ACT_SHOT;
	return nat_redirect_back(skb);
}

/* A packet to a service frontend: keep the flow's backend from conntrack when still
 * usable, else select one and record the flow; then DNAT (and hairpin). */
static __always_inline int translate_to_service(struct __sk_buff *skb, const struct kbp_tuple *t,
						const struct kbp_service *svc)
{
	__u32 bytes = skb->len;
	__u32 service_id = svc->service_id;
	__u64 now = kbp_now();
	struct kbp_ct_entry *flow = ct_lookup_forward(t);
	struct kbp_backend *backend;
	__u32 backend_id = 0, set_id, count;
	__be32 addr[4];
	__be16 port, sport = t->sport;
	int lost;
	int hairpin;

	if (flow && ct_left_to_netfilter(flow, t, now))
		return TC_ACT_OK;
	if (flow && ct_forward_is_usable(flow, svc, t)) {
		ct_touch_forward(flow, t, now);
		__builtin_memcpy(addr, flow->addr, sizeof(addr));
		port = flow->port;
		hairpin = flow->flags & KBP_CT_F_HAIRPIN;
		if (flow->flags & KBP_CT_F_SPORT)
			sport = flow->nat_port;
	} else {
		lost = ct_note_lost(t, flow);
		if (lost && ct_handoff())
			return TC_ACT_OK;
		if (!lb_source_admitted(t, svc))
			return drop_service_packet(bytes, service_id, KBP_DROP_SOURCE_RANGE);
		lb_set_for_pods(svc, &set_id, &count);
		if (count == 0)
			return translate_to_empty_set(skb, t, svc);
		backend = lb_select_backend(t, svc, set_id, count, now, &backend_id);
		if (!backend)
			return drop_service_packet(bytes, service_id, KBP_DROP_BACKEND_GONE);
		/* Service ids are per family, so this only guards against a corrupt entry. */
		if (backend->family != t->family)
			return drop_service_packet(bytes, service_id, KBP_DROP_NAT_FAILED);
		if (flow)
			ct_forget_reply_of(t, flow);
		hairpin = lb_addr_equal(t->saddr, backend->addr);
		/* Without its reply entry the flow's answers would reach the client from the
		 * backend address, which it would reset; better not to start it. */
		if (ct_create(t, svc, backend_id, backend, hairpin, now, lost, &sport))
			return drop_service_packet(bytes, service_id, KBP_DROP_NAT_FAILED);
		lb_remember_affinity(t, svc, now, backend_id);
		count_new_flow(service_id);
		__builtin_memcpy(addr, backend->addr, sizeof(addr));
		port = backend->port;
	}
	if (nat_dnat(skb, t, addr, port, sport, hairpin))
		return drop_service_packet(bytes, service_id, KBP_DROP_NAT_FAILED);
	count_service_packet(service_id, bytes);
	if (hairpin)
		return nat_redirect_back(skb);
	return TC_ACT_OK;
}

#endif /* KBP_LIB_TRANSLATE_H */
