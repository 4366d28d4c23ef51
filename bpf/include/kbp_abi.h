/* SPDX-License-Identifier: Apache-2.0 */
/*
 * kube-bpf-proxy ABI: every struct shared by the C programs and the Python agent.
 *
 * The agent derives its layouts from this very file with cffi (agent/dataplane/ebpf/abi.py),
 * so there is no second list of fields to keep in sync. Rules, checked by
 * tests/unit/test_abi.py against tests/golden/abi-layout.txt:
 *   - explicit padding (`pad` fields), so no struct has implicit holes or tail padding;
 *   - no bitfields; fixed-width types only;
 *   - byte order is in the type: __be16/__be32 are network order, everything else host;
 *   - changing any layout bumps KBP_ABI_VERSION, which is the `_vN` suffix of every map
 *     name, so an agent never reads a pinned map written with another layout.
 *
 * Only `#define NAME <integer>` lines and plain structs may appear here: cffi parses the
 * file after the agent strips the include guard.
 *
 * Addresses are four __be32 words: IPv4 in word 0 with words 1-3 zero, IPv6 in all four.
 * `family` (KBP_FAMILY_*) tells them apart.
 */
#ifndef KBP_ABI_H
#define KBP_ABI_H

#define KBP_ABI_VERSION 6

#define KBP_FAMILY_IPV4 4
#define KBP_FAMILY_IPV6 6

/* Frontend types (struct kbp_service.type), as NodeState's frontends[].type: for
 * inspect and explain; the programs read what a type means from the flags below
 * (KBP_SVC_F_EXTERNAL, KBP_SVC_F_SOURCE_RANGES) and from the sets the agent wrote. */
#define KBP_FE_CLUSTER_IP 1
#define KBP_FE_NODE_PORT 2
#define KBP_FE_EXTERNAL_IP 3
#define KBP_FE_LOAD_BALANCER 4

/* struct kbp_service.flags */
#define KBP_SVC_F_HAS_ENDPOINTS 1 /* empty set: DROP when set, REJECT when clear */
#define KBP_SVC_F_AFFINITY 2      /* sessionAffinity ClientIP for affinity_timeout s */
#define KBP_SVC_F_MAGLEV 4        /* slots are a Maglev table: pick by flow hash */
#define KBP_SVC_F_SOURCE_RANGES 8 /* LoadBalancer frontend with loadBalancerSourceRanges:
				     clients outside its kbp_src_ranges prefixes are dropped */
#define KBP_SVC_F_RANDOM 16       /* pick a random slot (lb-algorithm random); without it
				     and KBP_SVC_F_MAGLEV: the slot of the flow hash */
#define KBP_SVC_F_EXTERNAL 32     /* a frontend reached from outside the cluster (the
				     model's frontend type table): its address may be the
				     node's own, so replies are translated at the client */

/* Bits of struct kbp_src_range_key before the client address: the frontend key. */
#define KBP_SRC_RANGE_FRONTEND_BITS 160

/* struct kbp_backend.flags */
#define KBP_BE_F_LOCAL 1       /* the endpoint runs on this node */
#define KBP_BE_F_TERMINATING 2 /* serving while terminating (fallback) */

/* struct kbp_ct_key.dir */
#define KBP_CT_FORWARD 0 /* client -> frontend, as the client sent it */
#define KBP_CT_REPLY 1   /* backend -> client (or -> frontend for hairpin), as sent */
/* A spare copy of a reply entry, under the reply entry's key with this dir, written once
 * a flow has lived a second (lib/conntrack.h ct_keep_spare): a reply that finds no reply
 * entry is still translated when the spare and the flow's forward entry are there. */
#define KBP_CT_SPARE 2

/* struct kbp_ct_entry.flags */
#define KBP_CT_F_HAIRPIN 1 /* client is its own backend: source NATed to the frontend */
#define KBP_CT_F_SEEN_REPLY 2
#define KBP_CT_F_CLOSING 4 /* FIN or RST seen */
/* The frontend may be one of this node's addresses (NodePort, and ExternalIP/LB VIPs
 * a node can own): the reply is translated at the client's hook, not at the backend's
 * ingress, where a source that is this node's own address is dropped as martian. */
#define KBP_CT_F_REPLY_AT_CLIENT 8
/* A client outside the cluster reached a backend on another node: its source was
 * rewritten to this node's address and a port of the SNAT range (forward entry: nat_addr/
 * nat_port are that source; reply entry: they are the client to restore). */
#define KBP_CT_F_SNAT 16
/* The client's source port clashed: the reply tuple its port would give was held by a
 * live flow to another frontend (one client port used for two Services that share a
 * backend), so the port was remapped to a free one of the SNAT range, the client's
 * address kept (forward entry: nat_addr/nat_port are the client and the port it is
 * sent with; reply entry: the client and the port to restore), as netfilter's NAT does. */
#define KBP_CT_F_SPORT 32
#define KBP_CT_F_RST 64 /* a TCP RST was seen (KBP_CT_F_CLOSING is set too) */
#define KBP_CT_F_SPARE 128 /* forward entry: its reply entry has a spare (KBP_CT_SPARE) */

/* struct kbp_ct_entry.backend_id of a forward entry the agent seeds for a flow netfilter
 * translated before this agent served its frontend (kube-proxy's DNAT, at a takeover:
 * agent/dataplane/ebpf/handoff.py): its packets are left to netfilter, which holds its
 * NAT (lib/conntrack.h ct_left_to_netfilter). No backend has this id. */
#define KBP_CT_NETFILTER 4294967295 /* 0xffffffff */

/* Indexes of the kbp_ct_stats map (per-CPU __u64): conntrack events the agent reports. */
#define KBP_CT_STAT_LOST 0   /* a TCP segment other than a SYN found no forward entry (its
				 flow's entries were evicted or expired): the flow hash chose
				 its backend again */
#define KBP_CT_STAT_REMAPPED 1 /* a new flow's source port was remapped (KBP_CT_F_SPORT) */
#define KBP_CT_STATS 2

/* Indexes of the kbp_drops map: why the datapath dropped or rejected a packet. */
#define KBP_DROP_NO_BACKEND 0    /* empty set, hasEndpoints true: dropped */
#define KBP_DROP_REJECTED 1      /* empty set, hasEndpoints false: RST / ICMP sent */
#define KBP_DROP_BACKEND_GONE 2  /* a slot named a backend id that is not in the map */
#define KBP_DROP_MALFORMED 3     /* headers too short or inconsistent */
#define KBP_DROP_FRAGMENT 4      /* non-first IPv4 fragment / IPv6 fragment to a frontend */
#define KBP_DROP_NAT_FAILED 5    /* a helper refused to rewrite the packet */
#define KBP_DROP_REJECT_FAILED 6 /* could not build the RST / ICMP reply */
#define KBP_DROP_SOURCE_RANGE 7  /* loadBalancerSourceRanges does not admit the client */
#define KBP_DROP_NO_SNAT_PORT 8  /* every SNAT port tried for the flow was taken */
#define KBP_DROP_NO_ROUTE 9      /* no route to a backend on another node (FIB lookup) */
#define KBP_DROP_REASONS 10

/* Indexes of the kbp_xdp_stats map: what the XDP program did with a packet. */
#define KBP_XDP_PASS 0           /* left to tc and the stack (not a frontend, local backend,
				    REJECT, or a neighbour still unresolved) */
#define KBP_XDP_DROP_RANGE 1     /* loadBalancerSourceRanges refused the client */
#define KBP_XDP_DROP_NO_BACKEND 2 /* empty set with endpoints elsewhere (ETP Local) */
#define KBP_XDP_TX 3             /* forwarded, translated, out of the interface it came in */
#define KBP_XDP_REDIRECT 4       /* forwarded, translated, out of another interface */
#define KBP_XDP_DROP_OTHER 5     /* malformed, SNAT ports exhausted, rewrite failed */
#define KBP_XDP_VERDICTS 6

/* struct kbp_config.sock_lb: the sockets the connect/sendmsg hooks translate. */
#define KBP_SOCK_LB_HOST 1 /* the node's own network namespace (host-network pods too) */
#define KBP_SOCK_LB_PODS 2 /* the pods' network namespaces listed in kbp_pods */

/* Bits of a kbp_ports element (index: a port, host order). */
#define KBP_PORT_F_BACKEND 1  /* a backend served on it: replies can come from it */
#define KBP_PORT_F_FRONTEND 2 /* a frontend used it: packets to it can be for a Service */

/* kbp_sock_slots (see struct kbp_sock_slot): entries, a power of two; a socket's slot is
 * its cookie modulo this. Fixed, so that the agent finds a socket's slot as the programs
 * do whatever map sizes it was given. */
#define KBP_SOCK_SLOTS 65536

/* kbp_ct_gate (see kbp_maps.h): slots per side, a power of two; the selector's index is
 * 2 * KBP_CT_GATE_SLOTS, its values: */
#define KBP_CT_GATE_SLOTS 65536
#define KBP_CT_GATE_UNBUILT 0 /* no side built yet: every reply lookup is made */
#define KBP_CT_GATE_SIDE0 1   /* side 0 (indexes 0 .. SLOTS - 1) is the one read */
#define KBP_CT_GATE_SIDE1 2   /* side 1 (SLOTS .. 2 * SLOTS - 1) */

/* kbp_services: frontend address:port/protocol -> service. */
struct kbp_frontend_key {
	__be32 addr[4];  /* frontend IP (see the address rule above) */
	__be16 port;     /* frontend port */
	__u8 proto;      /* IPPROTO_TCP / IPPROTO_UDP / IPPROTO_SCTP */
	__u8 family;     /* KBP_FAMILY_* */
};

struct kbp_service {
	__u32 service_id;      /* stable per (Service, port, family): counters, affinity, CT */
	__u32 flags;           /* KBP_SVC_F_* */
	__u32 set_id;          /* backend slots for this frontend's traffic (docs/nodestate.md):
				  the index of the set's first slot in kbp_slots (0: none) */
	__u32 count;           /* slots in set_id; Maglev: the table size */
	__u32 internal_set_id; /* external frontends: slots for traffic from pods/node (the
				  first slot's index, as set_id) */
	__u32 internal_count;  /* slots in internal_set_id */
	__u32 affinity_timeout; /* seconds, when KBP_SVC_F_AFFINITY */
	__u8 type;             /* KBP_FE_* */
	__u8 pad[3];
};

/* kbp_slots (array, KBP_MAX_SLOTS): the backend sets services point at, each a run of
 * `count` consecutive slots from its first index (kbp_service.set_id; index 0 is never a
 * set's, so 0 names none), so a new flow's backend is read at set_id + hash % count with
 * no second hash lookup. A set is written in full into free slots before a service points
 * at it and zeroed only after no service does, so readers never see a half set or a mix
 * of two (agent/dataplane/ebpf/slots.py places them). */
struct kbp_slot {
	/* A copy of the backend's kbp_backends entry (struct kbp_backend, field for field),
	 * so a new flow's selection reads one map fewer; ids never change address or port,
	 * and the agent rewrites the copies when a backend's flags change. */
	__be32 addr[4];
	__be16 port;
	__u8 family;
	__u8 flags;
	__u32 service_id;
	__u32 backend_id; /* 0: a free slot (backend ids start at 1) */
};

/* kbp_backends: backend id -> endpoint address. Ids are per (service, endpoint): a
 * backend leaving a service deletes its id, which is how conntrack learns of it. */
struct kbp_backend {
	__be32 addr[4]; /* endpoint IP */
	__be16 port;    /* endpoint port */
	__u8 family;    /* KBP_FAMILY_* */
	__u8 flags;     /* KBP_BE_F_* */
	__u32 service_id;
};

/* kbp_hops (array of KBP_HOP_SLOTS, index a hash of the destination address): the next
 * hop toward an address a forwarded packet was sent to (a backend on another node, a
 * client outside), as the last FIB lookup for it found it, so that the flows after it skip
 * the lookup (lib/ext.h ext_next_hop): while kbp_hop_epoch is the one it was found under
 * and it is younger than KBP_HOP_WATCHED_NS, or, with kbp_hop_epoch 0 (no agent watches),
 * while younger than KBP_HOP_CACHE_NS. Addresses that share a slot take it in turn; the
 * answer depends on the interface the packet arrived on, so both are checked. Small on
 * purpose: a slot per backend (an array by backend id was measured) is a cold line for
 * every new flow to a rarely used backend, which cost more at 100k Services than the FIB
 * lookups it saved (bench/notes/katran.md). */
#define KBP_HOP_SLOTS 4096

struct kbp_hop {
	__u64 time;         /* CLOCK_MONOTONIC ns (coarse) of the lookup; 0: none yet */
	__be32 addr[4];     /* the destination address the lookup was for */
	__u32 in_ifindex;   /* the interface the packet was taken as arriving on */
	__u32 ifindex;      /* the next hop's interface */
	__u8 dmac[6];       /* the next hop's MAC address */
	__u8 smac[6];       /* ifindex's own MAC address */
	__u32 epoch;        /* kbp_hop_epoch when looked up (0: none) */
};

/* kbp_conntrack (LRU): one entry per direction of a translated flow. The key is the
 * packet's own tuple as it appears on the wire before translation. */
struct kbp_ct_key {
	__be32 saddr[4];
	__be32 daddr[4];
	__be16 sport;
	__be16 dport;
	__u8 proto;
	__u8 family;
	__u8 dir; /* KBP_CT_FORWARD / KBP_CT_REPLY / KBP_CT_SPARE */
	__u8 pad;
};

struct kbp_ct_entry {
	__be32 addr[4];  /* forward: backend IP (new dst); reply: frontend IP (new src) */
	__be16 port;     /* forward: backend port; reply: frontend port */
	__u8 flags;      /* KBP_CT_F_* */
	__u8 pad;
	__u32 backend_id;
	__u32 service_id;
	__u32 hop_ifindex;  /* forwarded flows (SNAT): the next hop's interface, see hop_time */
	__u64 last_seen; /* CLOCK_MONOTONIC ns of the last packet (coarse: tick resolution) */
	__be32 nat_addr[4]; /* KBP_CT_F_SNAT: forward: the new source; reply: the client */
	__be16 nat_port;    /* KBP_CT_F_SNAT: forward: the SNAT port; reply: the client's port */
	__u8 hop_dmac[6];   /* the next hop's MAC address */
	__u8 hop_smac[6];   /* hop_ifindex's own MAC address */
	__u16 pad2;
	__u64 hop_time;     /* CLOCK_MONOTONIC ns (coarse) of the FIB lookup that found the
			       hop_* fields, which are reused for KBP_HOP_CACHE_NS after it
			       (lib/ext.h); 0: none yet */
};

/* kbp_ct_remap (LRU): the source port a remapped flow (KBP_CT_F_SPORT) is sent with, by
 * its forward key, so a flow whose kbp_ct entries were lost is written again with the
 * same port, which its backend knows. Only remapped flows have one. */
struct kbp_ct_remap {
	__be16 port; /* network order, a port of the SNAT range */
	__u8 pad[6];
};

/* kbp_affinity (LRU): sessionAffinity ClientIP. */
struct kbp_affinity_key {
	__be32 client[4]; /* client IP */
	__u32 service_id;
	__u8 family;
	__u8 pad[3];
};

struct kbp_affinity {
	__u64 last_used; /* CLOCK_MONOTONIC ns (coarse: tick resolution) */
	__u32 backend_id;
	__u32 pad;
};

/* kbp_counters (per-CPU array, index service_id) and kbp_drops (per-CPU array, index
 * KBP_DROP_*): summed over CPUs by the agent. */
struct kbp_counters {
	__u64 packets; /* packets translated to a backend, both directions */
	__u64 bytes;   /* their bytes, L2 included */
	__u64 new_flows; /* backend selections (new connections, after CT misses) */
	__u64 drops;     /* packets to the service dropped or rejected */
};

struct kbp_drop_counters {
	__u64 packets;
	__u64 bytes;
};

/* kbp_src_ranges (LPM trie): loadBalancerSourceRanges per LoadBalancer frontend. The
 * prefix covers the whole frontend and then the range, so one trie serves them all and
 * the agent writes it straight from NodeState (no service ids involved). */
struct kbp_src_range_key {
	__u32 prefixlen;   /* KBP_SRC_RANGE_FRONTEND_BITS + the range's prefix length */
	__be32 fe_addr[4]; /* the LoadBalancer frontend the range guards: as kbp_frontend_key */
	__be16 fe_port;
	__u8 fe_proto;
	__u8 fe_family;
	__be32 addr[4];    /* the range's network address (address rule above) */
};

struct kbp_src_range {
	__u32 range_prefixlen; /* the range's own prefix length, for readers */
};

/* kbp_config (array, one entry at index 0): what the datapath needs to know of its node. */
struct kbp_config {
	__be32 node_addr4[4]; /* IPv4 source of SNATed flows (word 0; 0: none), and the client
				 address of the node's own sockets for ClientIP affinity */
	__be32 node_addr6[4]; /* the same for IPv6 (all zero: none) */
	__u64 host_netns_cookie; /* the node's network namespace: socket hooks act only here */
	__u16 snat_port_min;  /* SNAT source ports, host order, inclusive; outside the
				 node's ip_local_port_range so they never meet its own sockets */
	__u16 snat_port_max;
	__u8 pod_cidr4_len;   /* --cluster-cidr, IPv4: prefix length; 0: not configured */
	__u8 pod_cidr6_len;   /* the same for IPv6 */
	__u8 sock_lb;         /* KBP_SOCK_LB_* bits: whose sockets connect()/sendmsg() translate
				 (0: nobody's, --socket-lb off) */
	__u8 handoff;         /* 1 while the agent takes flows over from netfilter (its first
				 apply, until it has seeded KBP_CT_NETFILTER entries): a lost
				 TCP segment is left to netfilter (lib/conntrack.h ct_handoff) */
	__be32 pod_cidr4[4];  /* the IPv4 cluster CIDR's network address (word 0) */
	__be32 pod_cidr6[4];  /* the IPv6 cluster CIDR's network address */
	/* Conntrack lifetimes in seconds (the --conntrack-* timeouts the collector applies),
	 * by flow state: a new flow whose tuple is held by a flow past its lifetime takes
	 * the tuple over (lib/conntrack.h). 0: the state does not expire there. */
	__u32 ct_tcp_syn;
	__u32 ct_tcp_established;
	__u32 ct_tcp_close_wait;
	__u32 ct_tcp_time_wait;
	__u32 ct_udp;
	__u32 ct_udp_stream;
};

/* kbp_pods: a pod's network namespace cookie (bpf_get_netns_cookie()) -> its addresses,
 * written by the agent for each pod interface whose namespace it found (docs/ebpf.md). */
struct kbp_pod {
	__be32 addr4[4]; /* the pod's IPv4 address (word 0; 0: none) */
	__be32 addr6[4]; /* its IPv6 address (all zero: none) */
};

/* kbp_sock_rev (LRU): the sockets (the node's, the pods') that a hook pointed at a backend, so that
 * recvmsg/getpeername show the frontend the application asked for. */
struct kbp_sock_key {
	__u64 cookie;   /* bpf_get_socket_cookie() of the socket */
	__be32 addr[4]; /* backend IP the socket talks to */
	__be16 port;    /* backend port */
	__u8 family;    /* KBP_FAMILY_* */
	__u8 pad[5];
};

struct kbp_sock_rev {
	__be32 addr[4]; /* frontend IP */
	__be16 port;    /* frontend port */
	__u8 pad[2];
	__u32 service_id;
};

/* kbp_sock_peer (socket storage): a TCP socket the connect hook pointed at a backend, and
 * the frontend that backend stands for (getpeername() shows it). Freed with the socket. */
struct kbp_sock_peer {
	__be32 backend[4];     /* the address the socket was pointed at */
	__be32 frontend[4];    /* the address the application asked for */
	__be16 backend_port;
	__be16 frontend_port;
	__u32 service_id;
	__u8 family;           /* KBP_FAMILY_* of both */
	__u8 pad[7];
};

/* kbp_sock_slots (array, KBP_SOCK_SLOTS): the record of a socket the connect hook
 * translated (TCP, connected UDP), in the slot its cookie names, held until the socket is
 * released; a socket whose slot another live socket holds keeps its record elsewhere
 * (lib/sock.h, "Records"). */
struct kbp_sock_slot {
	__u64 cookie;              /* bpf_get_socket_cookie() of the holder; 0: free */
	struct kbp_sock_peer peer; /* its backend and frontend */
	__u8 pad[8];               /* one 64-byte entry */
};

/* kbp_meta (array, one entry at index 0): which NodeState the maps hold, written by the
 * agent only (no program reads it). A restarted agent reports it as the held revision
 * until it has the cluster's state again. Zeroed before an apply starts writing and set
 * after it completed, so an apply cut short (agent killed) leaves "unknown", never a
 * revision the maps do not wholly hold. */
struct kbp_meta {
	__u8 revision[32];  /* sha256 of the NodeState's services (its `revision`); all zero:
			       none, or an apply did not complete */
	__u64 applied_ns;   /* when that apply completed, Unix time in ns */
	__u32 services;     /* NodeState service entries it held, for `inspect` */
	__u32 backends;     /* NodeState backends it held */
};

/* kbp_svc_drops (LRU per-CPU hash, __u64 packets): drops per service and reason, for
 * /metrics' kbp_service_drops_total{reason}. Written only on drops. */
struct kbp_svc_drop_key {
	__u32 service_id;
	__u32 reason; /* KBP_DROP_* */
};

/* `explain` runs its own build of kbp_from_pod and kbp_from_ext (compiled with
 * KBP_EXPLAIN, pinned by the agent beside the maps, never attached) on a packet it built,
 * BPF_PROG_TEST_RUN against the live maps. That build writes no conntrack, affinity or
 * counter entry: lib/maps.h's accessors divert those to kbp_explain. */
#define KBP_EXPLAIN_CT_COPIES 4

/* kbp_explain (per-CPU array, one entry): a dry run's scratch, read by `explain` after
 * the run. Array lengths are KBP_DROP_REASONS, KBP_XDP_VERDICTS, KBP_CT_STATS and
 * KBP_EXPLAIN_CT_COPIES (cffi reads no macros; maps.c asserts them). */
struct kbp_explain {
	__u32 ct_next;     /* the ct[] copy the next conntrack lookup hands out */
	__u32 ct_writes;   /* conntrack entries the run would have created or changed */
	__u32 affinity_writes; /* affinity entries it would have written */
	__u32 pad;
	struct kbp_counters service;  /* what it would have counted for its service */
	struct kbp_drop_counters drops[10];  /* and per drop reason */
	struct kbp_drop_counters xdp[6];     /* and per XDP verdict */
	__u64 ct_stats[2];                   /* and per conntrack event */
	struct kbp_ct_entry ct[4]; /* copies of the entries it looked up: touching a flow
				      changes a copy, never the live entry */
	struct kbp_ct_entry forward; /* the last forward entry it would have written */
};

#endif /* KBP_ABI_H */
