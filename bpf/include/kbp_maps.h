/* SPDX-License-Identifier: Apache-2.0 */
/*
 * The maps, pinned under KBP_PIN_DIR with BTF so `bpftool map dump pinned` prints field
 * names. Every program includes this header, so all programs of all agent generations
 * share one set of maps: an agent restart re-opens the pins and keeps conntrack.
 *
 * Set by the loader (agent/dataplane/ebpf/kernel.py) with -D:
 *   KBP_PIN_DIR        string literal, e.g. "/sys/fs/bpf/kube-bpf-proxy"
 *   KBP_MAX_SERVICES   frontends (kbp_services entries) and service ids
 *   KBP_MAX_SLOTS      backend slots over all sets, Maglev tables included
 *   KBP_MAX_BACKENDS   (service, endpoint) pairs
 *   KBP_MAX_CT         conntrack entries (two per flow)
 *   KBP_MAX_AFFINITY   ClientIP affinity entries
 *   KBP_MAX_SRC_RANGES loadBalancerSourceRanges prefixes over all services
 *   KBP_MAX_SOCK_REV   kbp_sock_rev: (socket, backend) records of unconnected UDP sockets
 *                      and of connected sockets without a slot of kbp_sock_slots
 *   KBP_MAX_PODS       pod network namespaces on this node
 * Pins carry the ABI version (`kbp_services_v<KBP_ABI_VERSION>`); kernel map names are
 * limited to 15 characters (BPF_OBJ_NAME_LEN), which is why conntrack is `kbp_ct`.
 */
#ifndef KBP_MAPS_H
#define KBP_MAPS_H

#include "kbp_abi.h"

#ifndef KBP_PIN_DIR
#error "KBP_PIN_DIR must be defined by the loader"
#endif /* KBP_PIN_DIR */
#ifndef KBP_MAX_SERVICES
#define KBP_MAX_SERVICES 65536
#endif /* KBP_MAX_SERVICES */
#ifndef KBP_MAX_SLOTS
#define KBP_MAX_SLOTS 262144
#endif /* KBP_MAX_SLOTS */
#ifndef KBP_MAX_BACKENDS
#define KBP_MAX_BACKENDS 262144
#endif /* KBP_MAX_BACKENDS */
#ifndef KBP_MAX_CT
#define KBP_MAX_CT 262144
#endif /* KBP_MAX_CT */
#ifndef KBP_MAX_CT_REMAP
#define KBP_MAX_CT_REMAP 16384
#endif /* KBP_MAX_CT_REMAP */
#ifndef KBP_MAX_AFFINITY
#define KBP_MAX_AFFINITY 65536
#endif /* KBP_MAX_AFFINITY */

#ifndef KBP_MAX_SRC_RANGES
#define KBP_MAX_SRC_RANGES 16384
#endif /* KBP_MAX_SRC_RANGES */
#ifndef KBP_MAX_SVC_DROPS
#define KBP_MAX_SVC_DROPS 16384
#endif /* KBP_MAX_SVC_DROPS */
#ifndef KBP_MAX_SOCK_REV
#define KBP_MAX_SOCK_REV 65536
#endif /* KBP_MAX_SOCK_REV */

#ifndef KBP_MAX_PODS
#define KBP_MAX_PODS 4096
#endif /* KBP_MAX_PODS */

#define __KBP_STR(x) #x
#define KBP_STR(x) __KBP_STR(x)
/* The pin path of map `name`: KBP_PIN_DIR/name_v<KBP_ABI_VERSION>. The version lives in
 * the pin (the map's identity for every agent, bpftool and `inspect`), not in the C name:
 * bcc refuses map calls (`kbp_services.lookup`) whose map name comes from a macro. */
#define KBP_PIN(name) KBP_PIN_DIR "/" #name "_v" KBP_STR(KBP_ABI_VERSION)

/* Frontend (ClusterIP/NodePort/... address:port/proto) -> service entry. */
BPF_TABLE_PINNED("hash", struct kbp_frontend_key, struct kbp_service, kbp_services,
		 KBP_MAX_SERVICES, KBP_PIN(kbp_services));

/* Slot index -> backend (its id and a copy of its entry): the backend sets services point
 * at, each a run of slots from the index the service names (struct kbp_slot). */
BPF_TABLE_PINNED("array", __u32, struct kbp_slot, kbp_slots, KBP_MAX_SLOTS,
		 KBP_PIN(kbp_slots));

/* Backend id -> endpoint address:port. */
BPF_TABLE_PINNED("hash", __u32, struct kbp_backend, kbp_backends, KBP_MAX_BACKENDS,
		 KBP_PIN(kbp_backends));

/* Destination address (hashed) -> its next hop (struct kbp_hop): a cache, written by the
 * programs only. */
BPF_TABLE_PINNED("array", __u32, struct kbp_hop, kbp_hops, KBP_HOP_SLOTS, KBP_PIN(kbp_hops));

/* Index 0: the next-hop epoch. The agent sets a new one when it starts and whenever a
 * route, a routing rule, a link or a neighbour's MAC address changes, which makes every
 * cached next hop stale at once; 0 when no agent watches. The agent's alone. */
BPF_TABLE_PINNED("array", __u32, __u32, kbp_hop_epoch, 1, KBP_PIN(kbp_hop_epoch));

/* Translated flows, both directions; LRU so the oldest idle flows make room. */
BPF_TABLE_PINNED("lru_hash", struct kbp_ct_key, struct kbp_ct_entry, kbp_ct, KBP_MAX_CT,
		 KBP_PIN(kbp_ct));

/* Remapped flows' source ports by forward key (struct kbp_ct_remap): rare, so small. */
BPF_TABLE_PINNED("lru_hash", struct kbp_ct_key, struct kbp_ct_remap, kbp_ct_remap,
		 KBP_MAX_CT_REMAP, KBP_PIN(kbp_ct_remap));

/* sessionAffinity ClientIP: (client, service) -> backend, with its last use. */
BPF_TABLE_PINNED("lru_hash", struct kbp_affinity_key, struct kbp_affinity, kbp_affinity,
		 KBP_MAX_AFFINITY, KBP_PIN(kbp_affinity));

/* Per service id: packets, bytes, new flows, drops; summed over CPUs by the agent. */
BPF_TABLE_PINNED("percpu_array", __u32, struct kbp_counters, kbp_counters, KBP_MAX_SERVICES,
		 KBP_PIN(kbp_counters));

/* Per KBP_DROP_* reason. */
BPF_TABLE_PINNED("percpu_array", __u32, struct kbp_drop_counters, kbp_drops, KBP_DROP_REASONS,
		 KBP_PIN(kbp_drops));

/* (service id, client prefix) -> admitted: loadBalancerSourceRanges. */
BPF_TABLE_PINNED("lpm_trie", struct kbp_src_range_key, struct kbp_src_range, kbp_src_ranges,
		 KBP_MAX_SRC_RANGES, KBP_PIN(kbp_src_ranges), BPF_F_NO_PREALLOC);

/* Index 0: the node's addresses, netns cookie and SNAT port range (struct kbp_config). */
BPF_TABLE_PINNED("array", __u32, struct kbp_config, kbp_config, 1, KBP_PIN(kbp_config));

/* Per KBP_XDP_* verdict of the XDP program. */
BPF_TABLE_PINNED("percpu_array", __u32, struct kbp_drop_counters, kbp_xdp_stats,
		 KBP_XDP_VERDICTS, KBP_PIN(kbp_xdp_stats));

/* (socket cookie, backend) -> frontend, for the sockets the socket hooks translated that
 * have no slot of kbp_sock_slots: unconnected UDP (one socket may send to many backends),
 * connected UDP whose slot was held, and a connected UDP socket's previous backend. */
BPF_TABLE_PINNED("lru_hash", struct kbp_sock_key, struct kbp_sock_rev, kbp_sock_rev,
		 KBP_MAX_SOCK_REV, KBP_PIN(kbp_sock_rev));

/* Per TCP socket the connect hook translated whose slot of kbp_sock_slots (below) was
 * held: its backend and frontend (struct kbp_sock_peer), kept by the socket itself and
 * freed with it. */
BPF_TABLE_PINNED("sk_storage", int, struct kbp_sock_peer, kbp_sock_peer, 0,
		 KBP_PIN(kbp_sock_peer), BPF_F_NO_PREALLOC);

/* Connected sockets' records, first choice: slot (cookie % KBP_SOCK_SLOTS) -> the socket
 * holding it and its backend and frontend (struct kbp_sock_slot). Taking one is a
 * compare-and-swap and a few stores, where socket storage or an LRU entry cost about
 * 0.35 µs a connect() (bench/README.md, PB-2); the sockets whose slot is held use
 * kbp_sock_peer (TCP) or kbp_sock_rev (UDP). */
BPF_TABLE_PINNED("array", __u32, struct kbp_sock_slot, kbp_sock_slots, KBP_SOCK_SLOTS,
		 KBP_PIN(kbp_sock_slots));

/* Pod network namespace cookie -> the pod's addresses: whose sockets are pods'. */
BPF_TABLE_PINNED("hash", __u64, struct kbp_pod, kbp_pods, KBP_MAX_PODS, KBP_PIN(kbp_pods));

/* Per KBP_CT_STAT_* event: how often (per CPU). */
BPF_TABLE_PINNED("percpu_array", __u32, __u64, kbp_ct_stats, KBP_CT_STATS,
		 KBP_PIN(kbp_ct_stats));

/* Port (host order) -> KBP_PORT_F_*: which ports a backend ever served on, and which a
 * frontend ever used. Every reply entry of kbp_ct has a backend's port as its source
 * port and every frontend key its own port, so a packet from another source port skips
 * the reply lookup (clients' ephemeral ports) and one to another destination port the
 * frontend lookup (the node's own traffic: ssh, kubelet, ...). The agent sets a bit
 * before it writes a backend or frontend with that port and never clears one while the
 * maps live (removed backends' flows still drain; a stale bit costs one lookup). */
BPF_TABLE_PINNED("array", __u32, __u8, kbp_ports, 65536, KBP_PIN(kbp_ports));

/* Could tc have translated a flow whose reply entry has this (source, source port,
 * destination)? A filter over kbp_ct's reply entries, so that packets of flows tc never
 * translated (the socket hooks' flows to backends, pods' direct connections to a pod
 * that is a backend elsewhere) skip the conntrack lookups. Index: a hash of the reply
 * key's backend address and port and client address (maps.c __ct_gate_slot_of, the
 * collector's ctgate.py the same), on two sides of KBP_CT_GATE_SLOTS bytes each, then
 * the selector (KBP_CT_GATE_*): the datapath sets a slot on both sides after it writes a
 * reply entry; the collector zeroes the side not read, dumps kbp_ct, sets that side's
 * slots of the reply entries it keeps and makes it the side read. A slot reads 0 only
 * when no reply entry with its hash can exist; a set slot costs the lookup as before. */
BPF_TABLE_PINNED("array", __u32, __u8, kbp_ct_gate, 2 * KBP_CT_GATE_SLOTS + 1,
		 KBP_PIN(kbp_ct_gate));

/* Index 0: the NodeState revision the maps hold (struct kbp_meta); the agent's alone. */
BPF_TABLE_PINNED("array", __u32, struct kbp_meta, kbp_meta, 1, KBP_PIN(kbp_meta));

/* (service id, drop reason) -> packets, per CPU; LRU: the least recently dropping pairs
 * make room (their counts restart). */
BPF_TABLE_PINNED("lru_percpu_hash", struct kbp_svc_drop_key, __u64, kbp_svc_drops,
		 KBP_MAX_SVC_DROPS, KBP_PIN(kbp_svc_drops));

/* Index 0: the scratch of `explain`'s dry runs (struct kbp_explain), per CPU. */
BPF_TABLE_PINNED("percpu_array", __u32, struct kbp_explain, kbp_explain, 1,
		 KBP_PIN(kbp_explain));

#endif /* KBP_MAPS_H */
