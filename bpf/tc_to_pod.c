/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tc egress on a pod-facing host veth: packets to the pod. Replies of flows the pod
 * opened to a service arrive from the backend and get the frontend back as source.
 */
#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/parse.h"
#include "lib/translate.h"

int kbp_to_pod(struct __sk_buff *skb)
{
	struct kbp_tuple t = {};
	struct kbp_ct_entry *reply;
	struct kbp_ports_seen seen;

	/* No reply entry can match (ct_reply_possible, on what parse_ports_in_place read):
	 * most packets pass here, before the parse. */
	if (parse_ports_in_place(skb, &seen) &&
	    !ct_reply_possible(seen.sport, seen.saddr_fold, seen.daddr_fold))
		return TC_ACT_OK;
	/* Not ours to police: whatever we cannot parse goes to the pod as it is. */
	if (parse_packet(skb, &t) != KBP_PARSE_L4)
		return TC_ACT_OK;
	reply = ct_lookup_reply(&t);
	if (!reply)
		return TC_ACT_OK;
	return translate_reply(skb, &t, reply, 0);
}
