/* SPDX-License-Identifier: Apache-2.0 */
/*
 * tc ingress on a pod-facing host veth: packets leaving the pod. A backend's reply is
 * reverse-translated (hairpin replies turned around to the pod); a packet to a service
 * frontend is translated to a backend, or rejected / dropped when the set is empty.
 * Everything else passes untouched.
 *
 * This file comes first in the one text the loader compiles (tc_to_pod.c follows), so
 * it also defines the map accessors of lib/maps.h: bcc rewrites map calls only in the
 * main text, never in included headers.
 */
#include "lib/common.h"
#include "lib/conntrack.h"
#include "lib/lb.h"
#include "lib/maps.h"
#include "lib/parse.h"
#include "lib/translate.h"

static __always_inline struct kbp_service *map_lookup_service(struct kbp_frontend_key *key)
{
	return kbp_services.lookup(key);
}

static __always_inline struct kbp_slot *map_lookup_slot(struct kbp_slot_key *key)
{
	return kbp_slots.lookup(key);
}

static __always_inline struct kbp_backend *map_lookup_backend(__u32 *backend_id)
{
	return kbp_backends.lookup(backend_id);
}

static __always_inline struct kbp_ct_entry *map_lookup_ct(struct kbp_ct_key *key)
{
	return kbp_ct.lookup(key);
}

static __always_inline int map_update_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry)
{
	return kbp_ct.update(key, entry);
}

static __always_inline int map_delete_ct(struct kbp_ct_key *key)
{
	return kbp_ct.delete(key);
}

static __always_inline struct kbp_affinity *map_lookup_affinity(struct kbp_affinity_key *key)
{
	return kbp_affinity.lookup(key);
}

static __always_inline int map_update_affinity(struct kbp_affinity_key *key,
					       struct kbp_affinity *value)
{
	return kbp_affinity.update(key, value);
}

static __always_inline struct kbp_counters *map_lookup_counters(__u32 *service_id)
{
	return kbp_counters.lookup(service_id);
}

static __always_inline struct kbp_drop_counters *map_lookup_drops(__u32 *reason)
{
	return kbp_drops.lookup(reason);
}

int kbp_from_pod(struct __sk_buff *skb)
{
	struct kbp_tuple t = {};
	struct kbp_ct_entry *reply;
	struct kbp_service *svc;
	int parsed = parse_packet(skb, &t);

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
