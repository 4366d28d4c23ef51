/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Packet parsing with bounds checks: Ethernet, then IPv4 (options, fragments) or IPv6,
 * then the TCP/UDP ports, into a small tuple the rest of the datapath works on.
 */
#ifndef KBP_LIB_PARSE_H
#define KBP_LIB_PARSE_H

#include "lib/common.h"

/* What parse_packet found. */
#define KBP_PARSE_L4 0        /* TCP or UDP with both ports: the tuple is complete */
#define KBP_PARSE_OTHER 1     /* not IP, another protocol, or IPv6 extension headers */
#define KBP_PARSE_FRAGMENT 2  /* an IPv4 fragment after the first: no ports to read */
#define KBP_PARSE_MALFORMED 3 /* IP or TCP/UDP header too short or inconsistent */

/* The IP header follows an untagged Ethernet header: pod veths carry no VLAN tags. */
#define KBP_L3_OFF ETH_HLEN

/* Headers we read at most: Ethernet + IPv4 with 40 bytes of options + TCP without
 * options (IPv6: 14 + 40 + 20 is less). */
#define KBP_PARSE_PULL_LEN (ETH_HLEN + 60 + 20)

/* IPv4 frag_off bits (host order): fragment offset, don't fragment. */
#define KBP_IP_OFFSET 0x1fff
#define KBP_IP_DF 0x4000

struct kbp_tuple {
	__be32 saddr[4]; /* source IP, ABI address rule (IPv4 in word 0) */
	__be32 daddr[4]; /* destination IP */
	__be16 sport;    /* network order */
	__be16 dport;
	__u8 proto;      /* IPPROTO_TCP / IPPROTO_UDP (others stop at KBP_PARSE_OTHER) */
	__u8 family;     /* KBP_FAMILY_* */
	__u8 tcp_flags;  /* byte 13 of the TCP header (KBP_TCP_*), 0 for UDP */
	__u8 pad;
	__u16 l4_off;    /* offset of the TCP/UDP header in the frame */
	__u16 pad2;
};

/* A TCP flags byte (byte 13 of the header) of a SYN without ACK: a connection's first
 * segment. */
static __always_inline int __tcp_flags_syn_only(__u8 flags)
{
	return (flags & (KBP_TCP_SYN | KBP_TCP_ACK)) == KBP_TCP_SYN;
}

static __always_inline int tuple_is_tcp_syn(const struct kbp_tuple *t)
{
	return t->proto == IPPROTO_TCP && __tcp_flags_syn_only(t->tcp_flags);
}

/* The header rules, written once for parse_frame and parse_ports_in_place: what makes
 * a header malformed, and which IPv4 packets have no ports to read. */

/* An IPv4 header (whole in the linear area) that says it is one, at least 20 bytes long. */
static __always_inline int __ipv4_header_valid(const struct iphdr *ip)
{
	return ip->version == 4 && ip->ihl >= 5;
}

/* An IPv4 fragment after the first: its L4 header is in the first one. */
static __always_inline int __ipv4_later_fragment(const struct iphdr *ip)
{
	return ip->frag_off & bpf_htons(KBP_IP_OFFSET);
}

/* An IPv6 fixed header whole in [ip6, data_end) that says it is one. */
static __always_inline int __ipv6_header_valid(const struct ipv6hdr *ip6, void *data_end)
{
	return (void *)(ip6 + 1) <= data_end && ip6->version == 6;
}

/* A TCP header's fixed 20 bytes whole in [tcp, data_end), its data offset covering them. */
static __always_inline int __tcp_header_valid(const struct tcphdr *tcp, void *data_end)
{
	return (void *)(tcp + 1) <= data_end && tcp->doff >= 5;
}

/* A UDP header whole in [udp, data_end). */
static __always_inline int __udp_header_valid(const struct udphdr *udp, void *data_end)
{
	return (void *)(udp + 1) <= data_end;
}

static __always_inline int __parse_ports(void *l4, void *data_end, struct kbp_tuple *t)
{
	if (t->proto == IPPROTO_TCP) {
		struct tcphdr *tcp = l4;

		if (!__tcp_header_valid(tcp, data_end))
			return KBP_PARSE_MALFORMED;
		t->sport = tcp->source;
		t->dport = tcp->dest;
		t->tcp_flags = ((__u8 *)tcp)[13];
		return KBP_PARSE_L4;
	}
	if (t->proto == IPPROTO_UDP) {
		struct udphdr *udp = l4;

		if (!__udp_header_valid(udp, data_end))
			return KBP_PARSE_MALFORMED;
		t->sport = udp->source;
		t->dport = udp->dest;
		return KBP_PARSE_L4;
	}
	return KBP_PARSE_OTHER;
}

static __always_inline int __parse_ipv4(void *data, void *data_end, struct kbp_tuple *t)
{
	struct iphdr *ip = data + KBP_L3_OFF;
	__u32 hlen;

	if ((void *)(ip + 1) > data_end || !__ipv4_header_valid(ip))
		return KBP_PARSE_MALFORMED;
	hlen = ip->ihl * 4;
	t->family = KBP_FAMILY_IPV4;
	t->proto = ip->protocol;
	t->saddr[0] = ip->saddr;
	t->daddr[0] = ip->daddr;
	t->l4_off = KBP_L3_OFF + hlen;
	if (t->proto != IPPROTO_TCP && t->proto != IPPROTO_UDP)
		return KBP_PARSE_OTHER;
	/* Later fragments carry no ports; the first one (offset 0) is parsed as usual. */
	if (__ipv4_later_fragment(ip))
		return KBP_PARSE_FRAGMENT;
	return __parse_ports((void *)ip + hlen, data_end, t);
}

static __always_inline int __parse_ipv6(void *data, void *data_end, struct kbp_tuple *t)
{
	struct ipv6hdr *ip6 = data + KBP_L3_OFF;

	if (!__ipv6_header_valid(ip6, data_end))
		return KBP_PARSE_MALFORMED;
	t->family = KBP_FAMILY_IPV6;
	t->proto = ip6->nexthdr;
	__builtin_memcpy(t->saddr, &ip6->saddr, 16);
	__builtin_memcpy(t->daddr, &ip6->daddr, 16);
	t->l4_off = KBP_L3_OFF + sizeof(*ip6);
	/* Only TCP/UDP directly after the fixed header; extension headers (fragments
	 * included) are not walked and pass unchanged (documented limitation). */
	return __parse_ports(ip6 + 1, data_end, t);
}

/* Fill `t` from the frame in [data, data_end): returns KBP_PARSE_*. The XDP program calls
 * this directly (its frame is linear); tc goes through parse_packet. */
static __always_inline int parse_frame(void *data, void *data_end, struct kbp_tuple *t)
{
	struct ethhdr *eth = data;

	if ((void *)(eth + 1) > data_end)
		return KBP_PARSE_OTHER;
	if (eth->h_proto == bpf_htons(ETH_P_IP))
		return __parse_ipv4(data, data_end, t);
	if (eth->h_proto == bpf_htons(ETH_P_IPV6))
		return __parse_ipv6(data, data_end, t);
	return KBP_PARSE_OTHER;
}

/* How much of the frame parse_frame reads, as far as the first bytes tell: the headers
 * up to the L4 ports (TCP's first 20 bytes, UDP's 8), never the payload. What those
 * bytes do not show (a short linear area) counts as the most it can read. */
static __always_inline __u32 __parse_reads(void *data, void *data_end)
{
	struct ethhdr *eth = data;
	struct iphdr *ip = data + KBP_L3_OFF;

	if ((void *)(ip + 1) > data_end)
		return KBP_PARSE_PULL_LEN;
	if (eth->h_proto == bpf_htons(ETH_P_IP))
		return KBP_L3_OFF + ip->ihl * 4 + (ip->protocol == IPPROTO_UDP ? 8 : 20);
	if (eth->h_proto == bpf_htons(ETH_P_IPV6))
		return KBP_L3_OFF + sizeof(struct ipv6hdr) +
		       (((struct ipv6hdr *)ip)->nexthdr == IPPROTO_UDP ? 8 : 20);
	return ETH_HLEN;
}

/* Fill `t` from the skb; returns KBP_PARSE_*. May pull headers into the linear area,
 * which invalidates packet pointers the caller held (it holds none before parsing).
 *
 * Headers can sit in paged data (GRO, some drivers), which direct access does not see, so
 * what the parse reads is pulled into the linear area first, and only that: a local
 * socket's TCP segment has its headers linear and its payload in pages, and a pull that
 * reaches into the payload copies the whole head when the skb is a clone (every data
 * segment TCP sends is: the original waits in the retransmit queue). */
static __always_inline int parse_packet(struct __sk_buff *skb, struct kbp_tuple *t)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 want = __parse_reads(data, data_end);

	if (want > skb->len)
		want = skb->len;
	if (want > KBP_PARSE_PULL_LEN)
		want = KBP_PARSE_PULL_LEN;
	if (data + want > data_end) {
		if (bpf_skb_pull_data(skb, want) < 0)
			return KBP_PARSE_OTHER;
		data = (void *)(long)skb->data;
		data_end = (void *)(long)skb->data_end;
	}
	return parse_frame(data, data_end, t);
}

/* A packet as the pod-facing tc programs first look at it. */
struct kbp_ports_seen {
	__u32 saddr_fold; /* the addresses folded to one word (kbp_addr_fold) */
	__u32 daddr_fold;
	__be16 sport;
	__be16 dport;
	__u8 tcp_syn; /* a TCP SYN without ACK (tuple_is_tcp_syn) */
};

/* TCP or UDP ports read in place, without the tuple or a pull: 1 exactly when
 * parse_packet would return KBP_PARSE_L4 with these ports, and the headers are already
 * in the linear area; 0 sends the packet to parse_packet, which decides (not IP, another
 * protocol, a later fragment, IPv6 extension headers, paged or malformed headers).
 *
 * Most packets on a pod's veth are for no Service and no reply of a translated flow, and
 * the ports and addresses say so (kbp_ports, kbp_ct_gate); deciding that before the parse
 * fills a tuple takes 5-10 ns off a 60-100 ns run on real traffic (bench/README.md, "tc's
 * first look"). The header rules are parse_frame's (the __*_valid predicates above). */
static __always_inline int parse_ports_in_place(struct __sk_buff *skb, struct kbp_ports_seen *p)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct iphdr *ip = data + KBP_L3_OFF;
	struct ipv6hdr *ip6 = data + KBP_L3_OFF;
	__u8 *l4, proto;

	if ((void *)(ip + 1) > data_end)
		return 0;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		if (!__ipv4_header_valid(ip) || __ipv4_later_fragment(ip))
			return 0;
		proto = ip->protocol;
		p->saddr_fold = ip->saddr;
		p->daddr_fold = ip->daddr;
		l4 = (void *)ip + ip->ihl * 4;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		if (!__ipv6_header_valid(ip6, data_end))
			return 0;
		proto = ip6->nexthdr;
		p->saddr_fold = kbp_addr_fold(ip6->saddr.in6_u.u6_addr32);
		p->daddr_fold = kbp_addr_fold(ip6->daddr.in6_u.u6_addr32);
		l4 = (void *)(ip6 + 1);
	} else {
		return 0;
	}
	if (proto == IPPROTO_TCP) {
		if (!__tcp_header_valid((void *)l4, data_end))
			return 0;
		p->tcp_syn = __tcp_flags_syn_only(l4[13]);
	} else if (proto == IPPROTO_UDP) {
		if (!__udp_header_valid((void *)l4, data_end))
			return 0;
		p->tcp_syn = 0;
	} else {
		return 0;
	}
	p->sport = *(__be16 *)l4;
	p->dport = *(__be16 *)(l4 + 2);
	return 1;
}

#endif /* KBP_LIB_PARSE_H */
