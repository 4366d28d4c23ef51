/* SPDX-License-Identifier: Apache-2.0 */
/*
 * NAT: DNAT of a client's packet to its backend, reverse SNAT of the backend's reply to
 * the frontend, and hairpin (a pod that is its own backend) which rewrites both ends and
 * sends the packet back out the interface it came in on.
 *
 * Every rewrite is "make the packet's tuple equal to this one": at most two checksum
 * helper calls (addresses, ports), then the new header bytes.
 *
 * The tc programs write those bytes with bpf_skb_store_bytes, never through a packet
 * pointer: the verifier gives a program with a single direct packet write a prologue
 * that unclones every cloned skb it is run on (bpf_unclone_prologue), whatever the
 * program then does with it, and every data segment a TCP socket sends is a clone (the
 * original stays in the retransmit queue): the head of each such packet crossing a pod's
 * veth or the node's external interface was copied, translated or not. The helper makes
 * the skb writable only when a packet is rewritten. XDP has no clones and writes its
 * frame directly.
 */
#ifndef KBP_LIB_NAT_H
#define KBP_LIB_NAT_H

#include "lib/common.h"
#include "lib/csum.h"
#include "lib/lb.h"
#include "lib/parse.h"

/* The addresses and ports a packet is rewritten to. */
struct kbp_nat_target {
	__be32 saddr[4];
	__be32 daddr[4];
	__be16 sport;
	__be16 dport;
};
/* __nat_store_skb stores addresses and ports of an IPv6 packet from it as they are laid
 * out on the wire. */
_Static_assert(__builtin_offsetof(struct kbp_nat_target, daddr) ==
			       __builtin_offsetof(struct kbp_nat_target, saddr) + 16 &&
		       __builtin_offsetof(struct kbp_nat_target, sport) ==
			       __builtin_offsetof(struct kbp_nat_target, daddr) + 16 &&
		       __builtin_offsetof(struct kbp_nat_target, dport) ==
			       __builtin_offsetof(struct kbp_nat_target, sport) + 2,
	       "struct kbp_nat_target must follow the IPv6 wire order");

static __always_inline void nat_target_of_packet(const struct kbp_tuple *t,
						 struct kbp_nat_target *to)
{
	__builtin_memcpy(to->saddr, t->saddr, sizeof(to->saddr));
	__builtin_memcpy(to->daddr, t->daddr, sizeof(to->daddr));
	to->sport = t->sport;
	to->dport = t->dport;
}

/* The frame's stores once the checksums are settled (XDP): addresses (with the IPv4
 * header checksum adjusted by the same difference) and ports. */
static __always_inline int __nat_store(void *data, void *data_end, const struct kbp_tuple *t,
				       const struct kbp_nat_target *to, __u32 addr_diff)
{
	__u32 l4_off = t->l4_off;
	__be16 *ports;

	if (t->family == KBP_FAMILY_IPV4) {
		struct iphdr *ip = data + KBP_L3_OFF;

		if ((void *)(ip + 1) > data_end)
			return -1;
		ip->check = csum_ipv4_header_update(ip->check, addr_diff);
		ip->saddr = to->saddr[0];
		ip->daddr = to->daddr[0];
	} else {
		struct ipv6hdr *ip6 = data + KBP_L3_OFF;

		if ((void *)(ip6 + 1) > data_end)
			return -1;
		__builtin_memcpy(&ip6->saddr, to->saddr, 16);
		__builtin_memcpy(&ip6->daddr, to->daddr, 16);
	}
	/* Bounds the offset for the verifier: an IPv4 header is at most 60 bytes. */
	if (l4_off > KBP_L3_OFF + 60)
		return -1;
	ports = data + l4_off;
	if ((void *)(ports + 2) > data_end)
		return -1;
	ports[0] = to->sport;
	ports[1] = to->dport;
	return 0;
}

/* The same stores into an skb (tc), through the helper (see the top of this file), in
 * as few calls as the header allows: without IPv4 options the header checksum, both
 * addresses and both ports are one run of 14 bytes, and an IPv6 packet's addresses and
 * ports one of 36 (`to` holds them in that order); IPv4 options put the ports apart. */
static __always_inline int __nat_store_skb(struct __sk_buff *skb, const struct kbp_tuple *t,
					   const struct kbp_nat_target *to, __u32 addr_diff)
{
	__u32 ports_off = t->l4_off;

	if (t->family == KBP_FAMILY_IPV4) {
		void *data = (void *)(long)skb->data;
		struct iphdr *ip = data + KBP_L3_OFF;
		struct {
			__be16 pad; /* keeps the addresses 4-byte aligned */
			__sum16 check;
			__be32 saddr;
			__be32 daddr;
			__be16 sport;
			__be16 dport;
		} h;
		__u32 check_off = KBP_L3_OFF + __builtin_offsetof(struct iphdr, check);
		__u32 ports_len = sizeof(h.sport) + sizeof(h.dport);
		__u32 len = sizeof(h) - sizeof(h.pad);

		if ((void *)(ip + 1) > (void *)(long)skb->data_end)
			return -1;
		h.check = csum_ipv4_header_update(ip->check, addr_diff);
		h.saddr = to->saddr[0];
		h.daddr = to->daddr[0];
		h.sport = to->sport;
		h.dport = to->dport;
		if (ports_off == KBP_L3_OFF + sizeof(*ip))
			return bpf_skb_store_bytes(skb, check_off, &h.check, len, 0) ? -1 : 0;
		if (bpf_skb_store_bytes(skb, check_off, &h.check, len - ports_len, 0))
			return -1;
		return bpf_skb_store_bytes(skb, ports_off, &h.sport, ports_len, 0) ? -1 : 0;
	}
	/* The parse reads no extension headers: the ports follow the fixed header. */
	if (ports_off != KBP_L3_OFF + sizeof(struct ipv6hdr))
		return -1;
	return bpf_skb_store_bytes(skb, KBP_L3_OFF + __builtin_offsetof(struct ipv6hdr, saddr),
				   (void *)to->saddr, 2 * sizeof(to->saddr) + 2 * sizeof(to->sport),
				   0) ? -1 : 0;
}

/* Rewrite the packet's addresses and ports to `to`, checksums included. */
static __always_inline int nat_rewrite(struct __sk_buff *skb, const struct kbp_tuple *t,
				       const struct kbp_nat_target *to)
{
	__u32 addr_diff = csum_add(csum_addr_diff(t, t->saddr, to->saddr),
				   csum_addr_diff(t, t->daddr, to->daddr));
	__u32 port_diff = csum_add(csum_port_diff(t->sport, to->sport),
				   csum_port_diff(t->dport, to->dport));

	if (csum_l4_apply(skb, t, addr_diff, 1))
		return -1;
	if (t->sport != to->sport || t->dport != to->dport) {
		if (csum_l4_apply(skb, t, port_diff, 0))
			return -1;
	}
	return __nat_store_skb(skb, t, to, addr_diff);
}

/* The same rewrite on a frame the program owns outright (XDP: no skb, so no checksum
 * state to consult). It assumes what a NIC hands XDP: complete L4 checksums, updated
 * here in place (RFC 1624). A zero IPv4 UDP checksum ("none") stays zero. */
static __always_inline int nat_rewrite_frame(void *data, void *data_end,
					     const struct kbp_tuple *t,
					     const struct kbp_nat_target *to)
{
	__u32 addr_diff = csum_add(csum_addr_diff(t, t->saddr, to->saddr),
				   csum_addr_diff(t, t->daddr, to->daddr));
	__u32 port_diff = csum_add(csum_port_diff(t->sport, to->sport),
				   csum_port_diff(t->dport, to->dport));
	__u32 l4_off = t->l4_off;
	__sum16 *check;

	if (l4_off > KBP_L3_OFF + 60)
		return -1;
	check = data + l4_off + (t->proto == IPPROTO_TCP ? KBP_TCP_CHECK_OFF : KBP_UDP_CHECK_OFF);
	if ((void *)(check + 1) > data_end)
		return -1;
	if (!(t->proto == IPPROTO_UDP && t->family == KBP_FAMILY_IPV4 && *check == 0)) {
		__sum16 sum = csum_fold(csum_add(csum_add((__u16)~*check, addr_diff), port_diff));

		*check = (t->proto == IPPROTO_UDP && sum == 0) ? (__sum16)0xffff : sum;
	}
	return __nat_store(data, data_end, t, to, addr_diff);
}

/* A forwarded packet's hop: IPv4 TTL (header checksum adjusted) or IPv6 hop limit minus
 * one, as the stack's forwarding would. -1 when it reached 1 (the stack must answer with
 * ICMP time exceeded, so the caller leaves the packet to it or drops it). The new bytes
 * from the header's `ttl` on (IPv4: ttl, protocol, check) or its `hop_limit` (IPv6:
 * bytes[0] only); the frame and skb writers below store them. */
#define KBP_HOP_OFF_V4 (KBP_L3_OFF + __builtin_offsetof(struct iphdr, ttl))
#define KBP_HOP_OFF_V6 (KBP_L3_OFF + __builtin_offsetof(struct ipv6hdr, hop_limit))

static __always_inline int __nat_next_hop(void *data, void *data_end, __u8 family,
					  __u8 bytes[4])
{
	if (family == KBP_FAMILY_IPV4) {
		struct iphdr *ip = data + KBP_L3_OFF;
		__be16 before, after;
		__sum16 check;

		if ((void *)(ip + 1) > data_end || ip->ttl <= 1)
			return -1;
		bytes[0] = ip->ttl - 1;
		bytes[1] = ip->protocol;
		/* ttl and protocol are one 16-bit word of the header checksum */
		__builtin_memcpy(&before, &ip->ttl, sizeof(before));
		__builtin_memcpy(&after, bytes, sizeof(after));
		check = csum_ipv4_header_update(ip->check, csum_port_diff(before, after));
		__builtin_memcpy(bytes + 2, &check, sizeof(check));
		return 0;
	}
	struct ipv6hdr *ip6 = data + KBP_L3_OFF;

	if ((void *)(ip6 + 1) > data_end || ip6->hop_limit <= 1)
		return -1;
	bytes[0] = ip6->hop_limit - 1;
	return 0;
}

/* The hop decremented in a frame (XDP). */
static __always_inline int nat_decrement_hop(void *data, void *data_end, __u8 family)
{
	__u8 bytes[4];

	if (__nat_next_hop(data, data_end, family, bytes))
		return -1;
	if (family == KBP_FAMILY_IPV4) {
		struct iphdr *ip = data + KBP_L3_OFF;

		if ((void *)(ip + 1) > data_end)
			return -1;
		__builtin_memcpy(&ip->ttl, bytes, 4);
		return 0;
	}
	struct ipv6hdr *ip6 = data + KBP_L3_OFF;

	if ((void *)(ip6 + 1) > data_end)
		return -1;
	ip6->hop_limit = bytes[0];
	return 0;
}

/* The hop decremented in an skb (tc), through the helper (see the top of this file). */
static __always_inline int nat_decrement_hop_skb(struct __sk_buff *skb, __u8 family)
{
	__u8 bytes[4];

	if (__nat_next_hop((void *)(long)skb->data, (void *)(long)skb->data_end, family, bytes))
		return -1;
	if (family == KBP_FAMILY_IPV4)
		return bpf_skb_store_bytes(skb, KBP_HOP_OFF_V4, bytes, 4, 0) ? -1 : 0;
	return bpf_skb_store_bytes(skb, KBP_HOP_OFF_V6, bytes, 1, 0) ? -1 : 0;
}

/* Would forwarding expire the packet (TTL / hop limit 1 or 0)? The stack must answer it
 * with ICMP time exceeded, so such packets are not forwarded by the programs. */
static __always_inline int nat_hop_expires(void *data, void *data_end, __u8 family)
{
	if (family == KBP_FAMILY_IPV4) {
		struct iphdr *ip = data + KBP_L3_OFF;

		return (void *)(ip + 1) > data_end || ip->ttl <= 1;
	}
	struct ipv6hdr *ip6 = data + KBP_L3_OFF;

	return (void *)(ip6 + 1) > data_end || ip6->hop_limit <= 1;
}

/* The target of a forwarded packet to a backend on another node: backend as the
 * destination, the SNAT address and port as the source. */
static __always_inline void nat_target_snat(const struct kbp_tuple *t,
					    const struct kbp_ct_entry *forward,
					    struct kbp_nat_target *to)
{
	__builtin_memcpy(to->saddr, forward->nat_addr, sizeof(to->saddr));
	__builtin_memcpy(to->daddr, forward->addr, sizeof(to->daddr));
	to->sport = forward->nat_port;
	to->dport = forward->port;
}

/* The target of a SNATed flow's reply: the frontend as the source, the client (kept in
 * the reply entry) as the destination. */
static __always_inline void nat_target_snat_reply(const struct kbp_ct_entry *reply,
						  struct kbp_nat_target *to)
{
	__builtin_memcpy(to->saddr, reply->addr, sizeof(to->saddr));
	__builtin_memcpy(to->daddr, reply->nat_addr, sizeof(to->daddr));
	to->sport = reply->port;
	to->dport = reply->nat_port;
}

/* Client -> frontend becomes client -> backend, from source port `sport` (the client's,
 * or the one a clash remapped it to). Hairpin (the client is its own backend): the source
 * becomes the frontend address too, source port kept; otherwise the pod would get a
 * packet from itself and answer it locally, unseen by us. */
static __always_inline int nat_dnat(struct __sk_buff *skb, const struct kbp_tuple *t,
				    const __be32 *backend_addr, __be16 backend_port, __be16 sport,
				    int hairpin)
{
	struct kbp_nat_target to;

	nat_target_of_packet(t, &to);
	__builtin_memcpy(to.daddr, backend_addr, sizeof(to.daddr));
	to.dport = backend_port;
	to.sport = sport;
	if (hairpin)
		__builtin_memcpy(to.saddr, t->daddr, sizeof(to.saddr));
	return nat_rewrite(skb, t, &to);
}

/* Backend -> client becomes frontend -> client, to the client's own port when a clash
 * had remapped it (KBP_CT_F_SPORT). For hairpin the reply went to the frontend address
 * (see nat_dnat) and goes back to the pod itself, which is the backend address, the
 * reply's own source. */
static __always_inline int nat_reverse_reply(struct __sk_buff *skb, const struct kbp_tuple *t,
					     const struct kbp_ct_entry *entry)
{
	struct kbp_nat_target to;

	nat_target_of_packet(t, &to);
	__builtin_memcpy(to.saddr, entry->addr, sizeof(to.saddr));
	to.sport = entry->port;
	if (entry->flags & KBP_CT_F_SPORT)
		to.dport = entry->nat_port;
	if (entry->flags & KBP_CT_F_HAIRPIN)
		__builtin_memcpy(to.daddr, t->saddr, sizeof(to.daddr));
	return nat_rewrite(skb, t, &to);
}

/* Send the packet back out of the interface it arrived on (egress), addressed to the
 * sender's MAC: used for hairpin and REJECT replies, which go back to the same pod. */
static __always_inline int nat_redirect_back(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	struct ethhdr *eth = data;
	__u8 macs[2 * ETH_ALEN];

	if ((void *)(eth + 1) > (void *)(long)skb->data_end)
		return TC_ACT_SHOT;
	__builtin_memcpy(macs, eth->h_source, ETH_ALEN);
	__builtin_memcpy(macs + ETH_ALEN, eth->h_dest, ETH_ALEN);
	if (bpf_skb_store_bytes(skb, 0, macs, sizeof(macs), 0))
		return TC_ACT_SHOT;
	return bpf_redirect(skb->ifindex, 0);
}

#endif /* KBP_LIB_NAT_H */
