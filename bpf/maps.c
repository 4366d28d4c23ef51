/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The map accessors declared in lib/maps.h. The loader puts this file first in the one
 * text it compiles (the hooks' files follow): bcc rewrites map calls (`map.lookup(&key)`)
 * only in that main text, never in included headers, so the libraries call these.
 */
#include "lib/common.h"
#include "lib/maps.h"

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

static __always_inline struct kbp_src_range *map_lookup_src_range(struct kbp_src_range_key *key)
{
	return kbp_src_ranges.lookup(key);
}

static __always_inline struct kbp_config *map_lookup_config(void)
{
	__u32 zero = 0;

	return kbp_config.lookup(&zero);
}

static __always_inline int map_insert_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry)
{
	return kbp_ct.insert(key, entry);
}

static __always_inline struct kbp_drop_counters *map_lookup_xdp_stats(__u32 *verdict)
{
	return kbp_xdp_stats.lookup(verdict);
}

static __always_inline struct kbp_sock_rev *map_lookup_sock_rev(struct kbp_sock_key *key)
{
	return kbp_sock_rev.lookup(key);
}

static __always_inline int map_update_sock_rev(struct kbp_sock_key *key, struct kbp_sock_rev *value)
{
	return kbp_sock_rev.update(key, value);
}

static __always_inline int map_delete_sock_rev(struct kbp_sock_key *key)
{
	return kbp_sock_rev.delete(key);
}

static __always_inline struct kbp_pod *map_lookup_pod(__u64 *netns_cookie)
{
	return kbp_pods.lookup(netns_cookie);
}

static __always_inline __u64 *map_lookup_ct_stats(__u32 *what)
{
	return kbp_ct_stats.lookup(what);
}

/* Scratch space for the new-flow paths (struct kbp_scratch, lib/maps.h). One per CPU and
 * not pinned: a program runs to its end on one CPU, and nothing outlives the run. */
BPF_PERCPU_ARRAY(kbp_scratch, struct kbp_scratch, 1);

static __always_inline struct kbp_scratch *map_scratch(void)
{
	__u32 zero = 0;

	return kbp_scratch.lookup(&zero);
}

static __always_inline struct kbp_ct_remap *map_lookup_ct_remap(struct kbp_ct_key *key)
{
	return kbp_ct_remap.lookup(key);
}

static __always_inline int map_update_ct_remap(struct kbp_ct_key *key, struct kbp_ct_remap *value)
{
	return kbp_ct_remap.update(key, value);
}

static __always_inline int map_delete_ct_remap(struct kbp_ct_key *key)
{
	return kbp_ct_remap.delete(key);
}

/* Has `port` (network order) ever been used as KBP_PORT_F_* `what`? See kbp_ports. */
static __always_inline int map_port_used(__be16 port, __u8 what)
{
	__u32 index = bpf_ntohs(port);
	__u8 *used = kbp_ports.lookup(&index);

	return used && (*used & what);
}
