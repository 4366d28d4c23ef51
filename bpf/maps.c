/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The map accessors declared in lib/maps.h. The loader puts this file first in the one
 * text it compiles (the hooks' files follow): bcc rewrites map calls (`map.lookup(&key)`)
 * only in that main text, never in included headers, so the libraries call these.
 */
#include "lib/common.h"
#include "lib/maps.h"

/* --- explain's dry runs (struct kbp_explain) ------------------------------------------ */

_Static_assert(sizeof(((struct kbp_explain *)0)->drops) ==
		       KBP_DROP_REASONS * sizeof(struct kbp_drop_counters),
	       "kbp_explain.drops");
_Static_assert(sizeof(((struct kbp_explain *)0)->xdp) ==
		       KBP_XDP_VERDICTS * sizeof(struct kbp_drop_counters),
	       "kbp_explain.xdp");
_Static_assert(sizeof(((struct kbp_explain *)0)->ct_stats) == KBP_CT_STATS * sizeof(__u64),
	       "kbp_explain.ct_stats");
_Static_assert(sizeof(((struct kbp_explain *)0)->ct) ==
		       KBP_EXPLAIN_CT_COPIES * sizeof(struct kbp_ct_entry),
	       "kbp_explain.ct");

/* The scratch of a dry run: in explain's build of the programs (compiled with
 * KBP_EXPLAIN, run only by BPF_PROG_TEST_RUN) every run is one, and this CPU's kbp_explain
 * takes what it would write; in the programs that carry packets the accessors have no
 * such branch at all (NULL is a constant, so the compiler drops the code). */
#ifdef KBP_EXPLAIN
static __always_inline struct kbp_explain *__explain_dry(void)
{
	__u32 zero = 0;

	return kbp_explain.lookup(&zero);
}
#else
static __always_inline struct kbp_explain *__explain_dry(void)
{
	return NULL;
}
#endif

/* --- the accessors ---------------------------------------------------------------------- */

static __always_inline struct kbp_service *map_lookup_service(struct kbp_frontend_key *key)
{
	return kbp_services.lookup(key);
}

static __always_inline struct kbp_slot *map_lookup_slot(__u32 index)
{
	return kbp_slots.lookup(&index);
}

static __always_inline struct kbp_backend *map_lookup_backend(__u32 *backend_id)
{
	return kbp_backends.lookup(backend_id);
}

_Static_assert((KBP_HOP_SLOTS & (KBP_HOP_SLOTS - 1)) == 0, "KBP_HOP_SLOTS: a power of two");

static __always_inline struct kbp_hop *map_hop(const __be32 *addr)
{
	__u32 h = kbp_addr_fold(addr) * 0x9e3779b1U;
	__u32 index = (h ^ (h >> 16)) & (KBP_HOP_SLOTS - 1);

	if (__explain_dry())
		return NULL;
	return kbp_hops.lookup(&index);
}

static __always_inline __u32 map_hop_epoch(void)
{
	__u32 zero = 0;
	__u32 *epoch;

	if (__explain_dry())
		return 0;
	epoch = kbp_hop_epoch.lookup(&zero);
	return epoch ? *epoch : 0;
}

/* A dry run gets a copy, so that touching the flow changes nothing live. */
static __always_inline struct kbp_ct_entry *map_lookup_ct(struct kbp_ct_key *key)
{
	struct kbp_ct_entry *entry = kbp_ct.lookup(key);
	struct kbp_explain *dry;
	__u32 copy;

	if (!entry)
		return NULL;
	dry = __explain_dry();
	if (!dry)
		return entry;
	copy = dry->ct_next++ & (KBP_EXPLAIN_CT_COPIES - 1);
	__builtin_memcpy(&dry->ct[copy], entry, sizeof(*entry));
	return &dry->ct[copy];
}

/* A dry run's writes are counted, and the forward entry kept, never written. */
static __always_inline int __explain_ct_write(struct kbp_explain *dry, struct kbp_ct_key *key,
					      struct kbp_ct_entry *entry)
{
	dry->ct_writes += 1;
	if (key->dir == KBP_CT_FORWARD)
		__builtin_memcpy(&dry->forward, entry, sizeof(*entry));
	return 0;
}

/* --- kbp_ct_gate (kbp_maps.h) ------------------------------------------------------------ */

/* The slot of a reply key: its backend (source) address and port and its client
 * (destination) address, each folded to one word (kbp_addr_fold), mixed with
 * multiplications and a 32-bit finalizer. The collector computes the same
 * (agent/dataplane/ebpf/ctgate.py slot_of). */
static __always_inline __u32 __ct_gate_slot_of(__u32 backend, __u32 client, __be16 port)
{
	__u32 h = (backend * 0x9e3779b1U) ^ client;

	h = (h * 0x85ebca6bU) ^ (__u32)port;
	h ^= h >> 16;
	h *= 0x7feb352dU;
	h ^= h >> 15;
	return h & (KBP_CT_GATE_SLOTS - 1);
}

static __always_inline __u32 __ct_gate_slot(const struct kbp_ct_key *key)
{
	return __ct_gate_slot_of(kbp_addr_fold(key->saddr), kbp_addr_fold(key->daddr), key->sport);
}

static __always_inline void __ct_gate_set(__u32 index)
{
	__u8 *slot = kbp_ct_gate.lookup(&index);

	if (slot && *slot == 0)
		*slot = 1;
}

/* After a reply entry or its spare (same addresses and ports) was written: its slot on
 * both sides, so that neither the side read now nor the one the collector is building can
 * miss it. */
static __always_inline void __ct_gate_note(const struct kbp_ct_key *key)
{
	__u32 slot;

	if (key->dir == KBP_CT_FORWARD)
		return;
	slot = __ct_gate_slot(key);
	__ct_gate_set(slot);
	__ct_gate_set(slot + KBP_CT_GATE_SLOTS);
}

static __always_inline int map_ct_reply_maybe(__u32 backend, __u32 client, __be16 port)
{
	__u32 index = 2 * KBP_CT_GATE_SLOTS;
	__u8 *selector = kbp_ct_gate.lookup(&index), *slot;

	if (!selector || *selector == KBP_CT_GATE_UNBUILT)
		return 1;
	index = __ct_gate_slot_of(backend, client, port);
	if (*selector == KBP_CT_GATE_SIDE1)
		index += KBP_CT_GATE_SLOTS;
	slot = kbp_ct_gate.lookup(&index);
	return !slot || *slot;
}

static __always_inline int map_update_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry)
{
	struct kbp_explain *dry = __explain_dry();
	int err;

	if (dry)
		return __explain_ct_write(dry, key, entry);
	err = kbp_ct.update(key, entry);
	if (err == 0)
		__ct_gate_note(key);
	return err;
}

static __always_inline int map_delete_ct(struct kbp_ct_key *key)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry) {
		dry->ct_writes += 1;
		return 0;
	}
	return kbp_ct.delete(key);
}

static __always_inline struct kbp_affinity *map_lookup_affinity(struct kbp_affinity_key *key)
{
	return kbp_affinity.lookup(key);
}

static __always_inline int map_update_affinity(struct kbp_affinity_key *key,
					       struct kbp_affinity *value)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry) {
		dry->affinity_writes += 1;
		return 0;
	}
	return kbp_affinity.update(key, value);
}

static __always_inline void map_touch_affinity(struct kbp_affinity *entry, __u64 now)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry) {
		dry->affinity_writes += 1;
		return;
	}
	entry->last_used = now;
}

static __always_inline struct kbp_counters *map_lookup_counters(__u32 *service_id)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry)
		return &dry->service;
	return kbp_counters.lookup(service_id);
}

static __always_inline struct kbp_drop_counters *map_lookup_drops(__u32 *reason)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry)
		return *reason < KBP_DROP_REASONS ? &dry->drops[*reason] : NULL;
	return kbp_drops.lookup(reason);
}

/* A dry run counts its drop in the scratch only (map_lookup_drops). */
static __always_inline void map_count_service_drop(__u32 service_id, __u32 reason)
{
	struct kbp_svc_drop_key key = {.service_id = service_id, .reason = reason};
	__u64 one = 1, *packets;

	if (__explain_dry())
		return;
	packets = kbp_svc_drops.lookup(&key);
	if (packets)
		*packets += 1;
	else
		kbp_svc_drops.update(&key, &one);
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

/* A dry run sees a taken key as taken (-EEXIST), so SNAT port choice and port clashes
 * come out as they would. */
static __always_inline int map_insert_ct(struct kbp_ct_key *key, struct kbp_ct_entry *entry)
{
	struct kbp_explain *dry = __explain_dry();

	int err;

	if (dry)
		return kbp_ct.lookup(key) ? -17 : __explain_ct_write(dry, key, entry);
	err = kbp_ct.insert(key, entry);
	if (err == 0)
		__ct_gate_note(key);
	return err;
}

static __always_inline struct kbp_drop_counters *map_lookup_xdp_stats(__u32 *verdict)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry)
		return *verdict < KBP_XDP_VERDICTS ? &dry->xdp[*verdict] : NULL;
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

static __always_inline struct kbp_sock_peer *map_sock_peer(struct bpf_sock *sk, int create)
{
	return kbp_sock_peer.sk_storage_get(sk, NULL, create ? BPF_SK_STORAGE_GET_F_CREATE : 0);
}

_Static_assert((KBP_SOCK_SLOTS & (KBP_SOCK_SLOTS - 1)) == 0, "KBP_SOCK_SLOTS: a power of two");

static __always_inline struct kbp_sock_slot *map_sock_slot(__u64 cookie)
{
	__u32 index = cookie & (KBP_SOCK_SLOTS - 1);

	return kbp_sock_slots.lookup(&index);
}

static __always_inline struct kbp_pod *map_lookup_pod(__u64 *netns_cookie)
{
	return kbp_pods.lookup(netns_cookie);
}

static __always_inline __u64 *map_lookup_ct_stats(__u32 *what)
{
	struct kbp_explain *dry = __explain_dry();

	if (dry)
		return *what < KBP_CT_STATS ? &dry->ct_stats[*what] : NULL;
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
