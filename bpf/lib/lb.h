/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Frontend lookup and backend selection: ClientIP affinity first, then a Maglev table
 * indexed by the flow hash, or a random slot. The agent decided which backends are in a
 * set (docs/nodestate.md); this file only picks among them.
 */
#ifndef KBP_LIB_LB_H
#define KBP_LIB_LB_H

#include "lib/common.h"
#include "lib/maps.h"
#include "lib/parse.h"

/* The service entry of the packet's destination address:port/protocol, or NULL; the
 * caller knows some frontend has that port (kbp_ports). */
static __always_inline struct kbp_service *__lb_lookup_service(const struct kbp_tuple *t)
{
	struct kbp_frontend_key key = {};

	__builtin_memcpy(key.addr, t->daddr, sizeof(key.addr));
	key.port = t->dport;
	key.proto = t->proto;
	key.family = t->family;
	return map_lookup_service(&key);
}

/* The same for any destination. */
static __always_inline struct kbp_service *lb_lookup_service(const struct kbp_tuple *t)
{
	if (!map_port_used(t->dport, KBP_PORT_F_FRONTEND)) /* no frontend has that port */
		return NULL;
	return __lb_lookup_service(t);
}

/* The backend set for traffic from pods: always the internal one, since the agent
 * writes internal_* == set_id/count for ClusterIPs and clusterBackends (the internal
 * set) for external frontends reached from inside (docs/nodestate.md). */
static __always_inline void lb_set_for_pods(const struct kbp_service *svc, __u32 *set_id,
					    __u32 *count)
{
	*set_id = svc->internal_set_id;
	*count = svc->internal_count;
	if (*set_id == 0)
		*count = 0;
}

static __always_inline int lb_addr_equal(const __be32 *a, const __be32 *b)
{
	return a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3];
}

/* The backend set for traffic from outside the cluster to an external frontend: the
 * externalTrafficPolicy's set (localBackends for Local); a ClusterIP has one set. */
static __always_inline void lb_set_for_outside(const struct kbp_service *svc, __u32 *set_id,
					       __u32 *count)
{
	*set_id = svc->set_id;
	*count = svc->count;
	if (*set_id == 0)
		*count = 0;
}

/* loadBalancerSourceRanges: does the LoadBalancer frontend admit the client? As
 * kube-proxy, the ranges guard the VIP whoever sends (pods too), never the NodePort. */
static __always_inline int lb_source_admitted(const struct kbp_tuple *t,
					      const struct kbp_service *svc)
{
	struct kbp_src_range_key key = {};

	if (!(svc->flags & KBP_SVC_F_SOURCE_RANGES))
		return 1;
	key.prefixlen = KBP_SRC_RANGE_FRONTEND_BITS + (t->family == KBP_FAMILY_IPV4 ? 32 : 128);
	__builtin_memcpy(key.fe_addr, t->daddr, sizeof(key.fe_addr));
	key.fe_port = t->dport;
	key.fe_proto = t->proto;
	key.fe_family = t->family;
	__builtin_memcpy(key.addr, t->saddr, sizeof(key.addr));
	return map_lookup_src_range(&key) != NULL;
}

/* Is `addr` inside the prefix `net`/`len` (address rule: IPv4 in word 0)? */
static __always_inline int lb_prefix_contains(const __be32 *net, __u32 len, const __be32 *addr)
{
#pragma unroll
	for (int i = 0; i < 4; i++) {
		__u32 bits = len > 32 * i ? len - 32 * i : 0;
		__be32 mask;

		if (bits == 0)
			break;
		mask = bits >= 32 ? 0xffffffff : bpf_htonl(~0U << (32 - bits));
		if ((addr[i] & mask) != (net[i] & mask))
			return 0;
	}
	return 1;
}

/* Did a packet that arrived on an external interface come from a pod of the cluster
 * (--cluster-cidr)? Such traffic uses clusterBackends, as from local pods (docs/nodestate.md). */
static __always_inline int lb_from_cluster_pod(const struct kbp_tuple *t,
					       const struct kbp_config *cfg)
{
	if (t->family == KBP_FAMILY_IPV4)
		return cfg->pod_cidr4_len && lb_prefix_contains(cfg->pod_cidr4, cfg->pod_cidr4_len,
								t->saddr);
	return cfg->pod_cidr6_len && lb_prefix_contains(cfg->pod_cidr6, cfg->pod_cidr6_len, t->saddr);
}

static __always_inline __u32 __lb_rotl(__u32 x, __u32 r)
{
	return (x << r) | (x >> (32 - r));
}

/* MurmurHash3 (x86_32) block mixing and finalizer, applied to a sequence of 32-bit
 * integers; chosen because it is well distributed and easy to mirror in Python. */
static __always_inline __u32 __lb_mix(__u32 h, __u32 k)
{
	k *= 0xcc9e2d51;
	k = __lb_rotl(k, 15);
	k *= 0x1b873593;
	h ^= k;
	h = __lb_rotl(h, 13);
	return h * 5 + 0xe6546b64;
}

/* Flow hash of the 5-tuple as the client sent it: the ten integers saddr[0..3],
 * daddr[0..3] (each word read in network order), sport << 16 | dport, proto; then
 * h ^= 40 and the Murmur3 finalizer. Seed 0. Same result on every node and boot. */
static __always_inline __u32 lb_flow_hash(const struct kbp_tuple *t)
{
	__u32 h = 0;

#pragma unroll
	for (int i = 0; i < 4; i++)
		h = __lb_mix(h, bpf_ntohl(t->saddr[i]));
#pragma unroll
	for (int i = 0; i < 4; i++)
		h = __lb_mix(h, bpf_ntohl(t->daddr[i]));
	h = __lb_mix(h, ((__u32)bpf_ntohs(t->sport) << 16) | bpf_ntohs(t->dport));
	h = __lb_mix(h, t->proto);
	h ^= 40;
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* The backend a backend id names, if it is still one of this service's backends. Ids
 * are per (service, endpoint) and deleted when the endpoint leaves, so existence plus
 * the service id is the test. */
static __always_inline struct kbp_backend *lb_backend_of_service(__u32 backend_id,
								 __u32 service_id)
{
	struct kbp_backend *backend = map_lookup_backend(&backend_id);

	if (!backend || backend->service_id != service_id)
		return NULL;
	return backend;
}

/* A slot starts with a copy of its backend's entry, field for field (kbp_abi.h). */
_Static_assert(__builtin_offsetof(struct kbp_slot, backend_id) == sizeof(struct kbp_backend),
	       "struct kbp_slot must start with the fields of struct kbp_backend");

/* The backend at `index` of the set whose first slot is `set_id`, read from the slot's
 * copy (one array read), and its id; NULL when the slot is not the service's (a free
 * slot reads as service 0, which no service has). */
static __always_inline struct kbp_backend *__lb_slot_backend(__u32 set_id, __u32 index,
							     __u32 service_id, __u32 *backend_id)
{
	struct kbp_slot *slot = map_lookup_slot(set_id + index);

	if (!slot || slot->service_id != service_id)
		return NULL;
	*backend_id = slot->backend_id;
	return (struct kbp_backend *)slot;
}

static __always_inline void __lb_affinity_key(const struct kbp_tuple *t, __u32 service_id,
					      struct kbp_affinity_key *key)
{
	__builtin_memcpy(key->client, t->saddr, sizeof(key->client));
	key->service_id = service_id;
	key->family = t->family;
}

/* The client's remembered backend, when affinity is on, not expired, and the backend
 * still serves the service; NULL otherwise. `*entry`: the affinity entry it came from. */
static __always_inline struct kbp_backend *__lb_affinity_backend(const struct kbp_tuple *t,
								 const struct kbp_service *svc,
								 __u64 now, __u32 *backend_id,
								 struct kbp_affinity **entry)
{
	struct kbp_affinity_key key = {};
	struct kbp_affinity *aff;
	struct kbp_backend *backend;

	if (!(svc->flags & KBP_SVC_F_AFFINITY))
		return NULL;
	__lb_affinity_key(t, svc->service_id, &key);
	aff = map_lookup_affinity(&key);
	if (!aff)
		return NULL;
	/* `now` is the coarse clock, which may trail a fine-clock last_used by a tick. */
	if (now > aff->last_used &&
	    now - aff->last_used > (__u64)svc->affinity_timeout * KBP_NS_PER_SEC)
		return NULL;
	*backend_id = aff->backend_id;
	backend = lb_backend_of_service(aff->backend_id, svc->service_id);
	if (backend)
		*entry = aff;
	return backend;
}

static __always_inline struct kbp_backend *lb_affinity_backend(const struct kbp_tuple *t,
							       const struct kbp_service *svc,
							       __u64 now, __u32 *backend_id)
{
	struct kbp_affinity *entry;

	return __lb_affinity_backend(t, svc, now, backend_id, &entry);
}

/* Remember (or refresh) the client's backend: kube-proxy's `recent --set` runs for each
 * new connection, so the timeout counts from the client's last new flow. */
static __always_inline void lb_remember_affinity(const struct kbp_tuple *t,
						 const struct kbp_service *svc, __u64 now,
						 __u32 backend_id)
{
	struct kbp_affinity_key key = {};
	struct kbp_affinity value = {.last_used = now, .backend_id = backend_id};

	if (!(svc->flags & KBP_SVC_F_AFFINITY))
		return;
	__lb_affinity_key(t, svc->service_id, &key);
	map_update_affinity(&key, &value);
}

/* lb_remember_affinity after lb_select_backend_by, which names the affinity entry the
 * backend came from, if it did: that entry is refreshed where it is (a map lookup marks
 * an LRU entry used as an update does), without the update's new element. */
static __always_inline void lb_refresh_affinity(const struct kbp_tuple *t,
						const struct kbp_service *svc, __u64 now,
						__u32 backend_id, struct kbp_affinity *entry)
{
	if (entry)
		map_touch_affinity(entry, now);
	else
		lb_remember_affinity(t, svc, now, backend_id);
}

/* The rule every hook selects by, for a new flow (or socket) and a non-empty set
 * (count > 0): the client's affinity backend when it has one, else the backend in the
 * slot `hash` picks (hash % count). The slot's copy of the backend is used, so the
 * selection reads the slots and not kbp_backends. NULL when the slot (or the affinity's
 * backend) is missing, which ordered agent writes rule out (counted
 * KBP_DROP_BACKEND_GONE). `*entry`: the affinity entry the backend came from, or NULL
 * (lb_refresh_affinity). */
static __always_inline struct kbp_backend *lb_select_backend_by(const struct kbp_tuple *t,
								const struct kbp_service *svc,
								__u32 set_id, __u32 count,
								__u64 now, __u32 hash,
								__u32 *backend_id,
								struct kbp_affinity **entry)
{
	struct kbp_backend *backend;

	*entry = NULL;
	backend = __lb_affinity_backend(t, svc, now, backend_id, entry);

	if (backend)
		return backend;
	return __lb_slot_backend(set_id, hash % count, svc->service_id, backend_id);
}

/* A packet's new flow: lb_select_backend_by's rule with the flow hash (the set's slots,
 * or its Maglev table), or, only for Services that ask for it, a random number. The hash
 * makes the choice repeatable: a TCP segment whose conntrack entry was evicted or expired
 * reaches the backend it had, as long as the set is unchanged. Written out rather than
 * calling lb_select_backend_by so that the hash is computed only after the affinity
 * lookup missed: computed first, it stays live across that lookup and kbp_from_ext's
 * stack grows past the verifier's 512 bytes. */
static __always_inline struct kbp_backend *lb_select_backend(const struct kbp_tuple *t,
							     const struct kbp_service *svc,
							     __u32 set_id, __u32 count, __u64 now,
							     __u32 *backend_id)
{
	struct kbp_backend *backend = lb_affinity_backend(t, svc, now, backend_id);
	__u32 hash;

	if (backend)
		return backend;
	if (svc->flags & KBP_SVC_F_RANDOM)
		hash = bpf_get_prandom_u32();
	else
		hash = lb_flow_hash(t);
	return __lb_slot_backend(set_id, hash % count, svc->service_id, backend_id);
}

#endif /* KBP_LIB_LB_H */
