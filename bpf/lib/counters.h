/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Per-CPU counters per service and per drop reason. Each CPU owns its slot of a per-CPU
 * array, so plain adds are enough (no atomics); the agent sums over CPUs.
 */
#ifndef KBP_LIB_COUNTERS_H
#define KBP_LIB_COUNTERS_H

#include "lib/common.h"
#include "lib/maps.h"

/* A packet translated for the service (either direction), `bytes` with L2 included. */
static __always_inline void count_service_packet(__u32 service_id, __u32 bytes)
{
	struct kbp_counters *c = map_lookup_counters(&service_id);

	if (c) {
		c->packets += 1;
		c->bytes += bytes;
	}
}

/* A backend selected for a new flow (conntrack miss or stale entry). */
static __always_inline void count_new_flow(__u32 service_id)
{
	struct kbp_counters *c = map_lookup_counters(&service_id);

	if (c)
		c->new_flows += 1;
}

/* A packet dropped or rejected, by reason; and by service when it was for one. */
static __always_inline void count_drop(__u32 reason, __u32 bytes)
{
	struct kbp_drop_counters *d = map_lookup_drops(&reason);

	if (d) {
		d->packets += 1;
		d->bytes += bytes;
	}
}

static __always_inline void count_service_drop(__u32 service_id, __u32 reason, __u32 bytes)
{
	struct kbp_counters *c = map_lookup_counters(&service_id);

	if (c)
		c->drops += 1;
	map_count_service_drop(service_id, reason);
	count_drop(reason, bytes);
}

#endif /* KBP_LIB_COUNTERS_H */
