/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Map access for the libraries. bcc 0.26 turns `map.lookup(&key)` into a map helper call
 * only in the main source text: in an included header the call silently compiles to an
 * indirect call through the table struct, which the verifier rejects ("unknown opcode
 * 8d"). So the libraries call these accessors, declared here and defined once in the
 * main text (maps.c, first in the text the loader compiles).
 */
#ifndef KBP_LIB_MAPS_H
#define KBP_LIB_MAPS_H

#include "lib/common.h"

static __always_inline struct kbp_service *map_lookup_service(struct kbp_frontend_key *key);
static __always_inline struct kbp_slot *map_lookup_slot(__u32 index);
static __always_inline struct kbp_backend *map_lookup_backend(__u32 *backend_id);
static __always_inline struct kbp_ct_entry *map_lookup_ct(struct kbp_ct_key *key);
/* The next-hop cache slot of a destination address (kbp_hops), to read and write in
 * place; NULL in explain's dry runs (which then ask the FIB). */
static __always_inline struct kbp_hop *map_hop(const __be32 *addr);
/* kbp_hop_epoch's value; 0 when nobody watches (or in explain's dry runs). */
static __always_inline __u32 map_hop_epoch(void);
static __always_inline int map_update_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry);
static __always_inline int map_delete_ct(struct kbp_ct_key *key);
/* May kbp_ct hold a reply entry from `backend`:`port` to `client` (addresses folded by
 * kbp_addr_fold), whatever the client's port (kbp_ct_gate)? 0 only when none can. */
static __always_inline int map_ct_reply_maybe(__u32 backend, __u32 client, __be16 port);
static __always_inline struct kbp_affinity *map_lookup_affinity(struct kbp_affinity_key *key);
static __always_inline int map_update_affinity(struct kbp_affinity_key *key,
					       struct kbp_affinity *value);
/* Set a looked-up affinity entry's last_used in place. */
static __always_inline void map_touch_affinity(struct kbp_affinity *entry, __u64 now);
static __always_inline struct kbp_counters *map_lookup_counters(__u32 *service_id);
static __always_inline struct kbp_drop_counters *map_lookup_drops(__u32 *reason);
static __always_inline struct kbp_src_range *map_lookup_src_range(struct kbp_src_range_key *key);
static __always_inline struct kbp_config *map_lookup_config(void);
/* Create only (BPF_NOEXIST): -EEXIST when the key is taken (SNAT port allocation). */
static __always_inline int map_insert_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry);
static __always_inline struct kbp_drop_counters *map_lookup_xdp_stats(__u32 *verdict);
static __always_inline struct kbp_sock_rev *map_lookup_sock_rev(struct kbp_sock_key *key);
static __always_inline int map_update_sock_rev(struct kbp_sock_key *key,
					       struct kbp_sock_rev *value);
static __always_inline int map_delete_sock_rev(struct kbp_sock_key *key);
/* The socket's kbp_sock_peer, created (zeroed) when `create` and it has none; NULL when
 * it has none (or it could not be created). */
static __always_inline struct kbp_sock_peer *map_sock_peer(struct bpf_sock *sk, int create);
/* The kbp_sock_slots entry a socket cookie names (whoever holds it). */
static __always_inline struct kbp_sock_slot *map_sock_slot(__u64 cookie);
static __always_inline struct kbp_pod *map_lookup_pod(__u64 *netns_cookie);
static __always_inline int map_port_used(__be16 port, __u8 what);
static __always_inline __u64 *map_lookup_ct_stats(__u32 *what);
static __always_inline struct kbp_ct_remap *map_lookup_ct_remap(struct kbp_ct_key *key);
static __always_inline int map_update_ct_remap(struct kbp_ct_key *key, struct kbp_ct_remap *value);
static __always_inline int map_delete_ct_remap(struct kbp_ct_key *key);
/* Per-CPU scratch space (map_scratch): the external path inlines ct_create and
 * ct_create_snat, and its 512 bytes of stack have no room for another entry or key. */
struct kbp_scratch {
	struct kbp_ct_key key;     /* another flow's key (__ct_take_over), a lost flow's
				      (__ct_remapped_port), a port record (__ct_record_remap) */
	struct kbp_ct_entry entry; /* the entries ct_create_snat writes */
};
static __always_inline struct kbp_scratch *map_scratch(void);

/* One more packet of `service_id` dropped for `reason` (kbp_svc_drops). */
static __always_inline void map_count_service_drop(__u32 service_id, __u32 reason);

/* `explain`'s dry runs: the programs compiled once more with KBP_EXPLAIN, loaded beside
 * the attached ones on the same pinned maps and run only by BPF_PROG_TEST_RUN, whose
 * accessors above write nothing live (maps.c). The attached programs carry no check. */

#endif /* KBP_LIB_MAPS_H */
