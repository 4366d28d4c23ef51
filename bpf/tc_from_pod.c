/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tc ingress on a pod-facing host veth: packets leaving the pod. A backend's reply is
 * reverse-translated (hairpin replies turned around to the pod); a packet to a service
 * frontend is translated to a backend, or rejected / dropped when the set is empty.
 * Everything else passes untouched.
 */
#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/lb.h"
#include "lib/parse.h"
#include "lib/translate.h"

static __always_inline int __kbp_from_pod(struct __sk_buff *skb)
{
	struct kbp_tuple t = {};
	struct kbp_ct_entry *reply;
	struct kbp_service *svc;
	struct kbp_ports_seen seen;
	int parsed;

	/* What the ports and addresses read in place settle, before the parse: not a
	 * backend's reply (ct_reply_possible), to a port no frontend ever used (no service),
	 * and not a SYN whose answers a reply entry could catch (ct_forget_reply_to). The
	 * full path below lets such a packet pass too. */
	if (parse_ports_in_place(skb, &seen) &&
	    !ct_reply_possible(seen.sport, seen.saddr_fold, seen.daddr_fold) &&
	    !map_port_used(seen.dport, KBP_PORT_F_FRONTEND) &&
	    !(seen.tcp_syn && ct_reply_possible(seen.dport, seen.daddr_fold, seen.saddr_fold)))
		return TC_ACT_OK;
	parsed = parse_packet(skb, &t);
	if (parsed == KBP_PARSE_MALFORMED)
		return drop_packet(skb->len, KBP_DROP_MALFORMED);
	/* Later IPv4 fragments have no ports to find a frontend or flow by: they pass
	 * (fragmented datagrams to services are a documented limitation). */
	if (parsed != KBP_PARSE_L4)
		return TC_ACT_OK;
	reply = ct_lookup_reply(&t);
	if (reply)
		return translate_reply(skb, &t, reply, 1);
	svc = lb_lookup_service(&t);
	if (!svc) {
		if (tuple_is_tcp_syn(&t))
			ct_forget_reply_to(&t);
		return TC_ACT_OK;
	}
	return translate_to_service(skb, &t, svc);
}

/* The entry (`explain` runs its own build of it: lib/maps.h). */
int kbp_from_pod(struct __sk_buff *skb)
{
	return __kbp_from_pod(skb);
}
