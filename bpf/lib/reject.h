/* SPDX-License-Identifier: Apache-2.0 */
/*
 * REJECT for a service without endpoints (hasEndpoints false), as kube-proxy does: the
 * client's packet is turned in place into a TCP RST or an ICMP / ICMPv6 port unreachable
 * from the frontend address; the caller sends it back out to the client.
 *
 * The replies carry full checksums. An skb with CHECKSUM_PARTIAL keeps that state; the
 * veth delivering it to the pod trusts it (no device finalises it on that path).
 */
#ifndef KBP_LIB_REJECT_H
#define KBP_LIB_REJECT_H

#include "lib/common.h"
#include "lib/csum.h"
#include "lib/parse.h"

/* Quoted in ICMP errors: the client's IP header (options included) and the first 8
 * bytes of its payload, the minimum of RFC 792 and enough for the client's stack to
 * find the socket (ports). */
#define KBP_QUOTE_L4 8
#define KBP_QUOTE_MAX (60 + KBP_QUOTE_L4)
#define KBP_QUOTE_V6 (sizeof(struct ipv6hdr) + KBP_QUOTE_L4)

/* reject_packet results besides 0 (reply built) and -1 (a helper failed). */
#define KBP_REJECT_SILENT 1 /* nothing may be sent back: drop quietly */

struct kbp_pseudo4 {
	__be32 saddr;
	__be32 daddr;
	__u8 zero;
	__u8 proto;
	__be16 len;
};

struct kbp_pseudo6 {
	__be32 saddr[4];
	__be32 daddr[4];
	__be32 len;
	__u8 zero[3];
	__u8 next;
};

/* Bytes of L4 payload the client sent after the TCP header. */
static __always_inline __u32 __reject_tcp_payload_len(struct __sk_buff *skb,
						      const struct kbp_tuple *t, __u32 doff)
{
	__be16 l3_len;
	__u32 headers;

	if (t->family == KBP_FAMILY_IPV4) {
		if (bpf_skb_load_bytes(skb, KBP_L3_OFF + 2, &l3_len, sizeof(l3_len)))
			return 0;
		headers = (t->l4_off - KBP_L3_OFF) + doff;
	} else {
		if (bpf_skb_load_bytes(skb, KBP_L3_OFF + 4, &l3_len, sizeof(l3_len)))
			return 0;
		headers = doff;
	}
	return bpf_ntohs(l3_len) > headers ? bpf_ntohs(l3_len) - headers : 0;
}

/* The client's TCP segment becomes RST|ACK from frontend to client. ack = seq + length
 * (+1 per SYN/FIN) acknowledges what was sent, which a SYN-SENT socket requires; seq is
 * the client's ack when it had one, which RFC 5961 needs to accept the reset. */
static __always_inline int reject_with_tcp_reset(struct __sk_buff *skb, const struct kbp_tuple *t)
{
	struct tcphdr in, out = {};
	__u32 sum, l3_hlen;

	if (bpf_skb_load_bytes(skb, t->l4_off, &in, sizeof(in)))
		return -1;
	/* Never answer a reset with a reset (RFC 793, "Reset Generation"). */
	if (in.rst)
		return KBP_REJECT_SILENT;
	out.source = in.dest;
	out.dest = in.source;
	out.seq = in.ack ? in.ack_seq : 0;
	out.ack_seq = bpf_htonl(bpf_ntohl(in.seq) + __reject_tcp_payload_len(skb, t, in.doff * 4) +
				in.syn + in.fin);
	out.doff = 5;
	out.rst = 1;
	out.ack = 1;

	if (t->family == KBP_FAMILY_IPV4) {
		struct iphdr ip = {};
		struct kbp_pseudo4 ph = {};

		ip.version = 4;
		ip.ihl = 5;
		ip.tot_len = bpf_htons(sizeof(ip) + sizeof(out));
		ip.frag_off = bpf_htons(KBP_IP_DF);
		ip.ttl = KBP_REPLY_TTL;
		ip.protocol = IPPROTO_TCP;
		ip.saddr = t->daddr[0];
		ip.daddr = t->saddr[0];
		ip.check = csum_fold(csum_add_bytes(&ip, sizeof(ip), 0));
		ph.saddr = ip.saddr;
		ph.daddr = ip.daddr;
		ph.proto = IPPROTO_TCP;
		ph.len = bpf_htons(sizeof(out));
		sum = csum_add_bytes(&ph, sizeof(ph), 0);
		out.check = csum_fold(csum_add_bytes(&out, sizeof(out), sum));
		if (bpf_skb_store_bytes(skb, KBP_L3_OFF, &ip, sizeof(ip), 0))
			return -1;
		l3_hlen = sizeof(ip);
	} else {
		struct ipv6hdr ip6 = {};
		struct kbp_pseudo6 ph = {};

		ip6.version = 6;
		ip6.payload_len = bpf_htons(sizeof(out));
		ip6.nexthdr = IPPROTO_TCP;
		ip6.hop_limit = KBP_REPLY_TTL;
		__builtin_memcpy(&ip6.saddr, t->daddr, 16);
		__builtin_memcpy(&ip6.daddr, t->saddr, 16);
		__builtin_memcpy(ph.saddr, t->daddr, 16);
		__builtin_memcpy(ph.daddr, t->saddr, 16);
		ph.len = bpf_htonl(sizeof(out));
		ph.next = IPPROTO_TCP;
		sum = csum_add_bytes(&ph, sizeof(ph), 0);
		out.check = csum_fold(csum_add_bytes(&out, sizeof(out), sum));
		if (bpf_skb_store_bytes(skb, KBP_L3_OFF, &ip6, sizeof(ip6), 0))
			return -1;
		l3_hlen = sizeof(ip6);
	}
	/* The client's segment is at least as long as the reply's headers (parsed above),
	 * so write first and cut the rest (options, payload) after. */
	if (bpf_skb_store_bytes(skb, KBP_L3_OFF + l3_hlen, &out, sizeof(out), 0))
		return -1;
	return bpf_skb_change_tail(skb, KBP_L3_OFF + l3_hlen + sizeof(out), 0) ? -1 : 0;
}

/* The client's UDP datagram (IPv4) becomes ICMP port unreachable from the frontend. */
static __always_inline int __reject_udp4(struct __sk_buff *skb, const struct kbp_tuple *t)
{
	struct {
		struct iphdr ip;
		struct icmphdr icmp;
	} reply = {};
	__u8 quote[KBP_QUOTE_MAX];
	__u8 first;
	__u32 qlen;

	if (bpf_skb_load_bytes(skb, KBP_L3_OFF, &first, 1))
		return -1;
	/* Derived from the header byte itself, so the verifier sees 8 <= qlen <= 68. */
	qlen = (first & 0x0f) * 4 + KBP_QUOTE_L4;
	if (bpf_skb_load_bytes(skb, KBP_L3_OFF, quote, qlen))
		return -1;

	reply.icmp.type = ICMP_DEST_UNREACH;
	reply.icmp.code = ICMP_PORT_UNREACH;
	reply.icmp.checksum = csum_fold(csum_add_bytes(quote, qlen,
						       csum_add_bytes(&reply.icmp, sizeof(reply.icmp), 0)));
	reply.ip.version = 4;
	reply.ip.ihl = 5;
	reply.ip.tot_len = bpf_htons(sizeof(reply) + qlen);
	reply.ip.frag_off = bpf_htons(KBP_IP_DF);
	reply.ip.ttl = KBP_REPLY_TTL;
	reply.ip.protocol = IPPROTO_ICMP;
	reply.ip.saddr = t->daddr[0];
	reply.ip.daddr = t->saddr[0];
	reply.ip.check = csum_fold(csum_add_bytes(&reply.ip, sizeof(reply.ip), 0));

	/* Resize first: the reply may be longer than a short datagram. */
	if (bpf_skb_change_tail(skb, KBP_L3_OFF + sizeof(reply) + qlen, 0))
		return -1;
	if (bpf_skb_store_bytes(skb, KBP_L3_OFF, &reply, sizeof(reply), 0))
		return -1;
	return bpf_skb_store_bytes(skb, KBP_L3_OFF + sizeof(reply), quote, qlen, 0) ? -1 : 0;
}

/* The client's UDP datagram (IPv6) becomes ICMPv6 port unreachable from the frontend. */
static __always_inline int __reject_udp6(struct __sk_buff *skb, const struct kbp_tuple *t)
{
	struct {
		struct ipv6hdr ip6;
		struct icmp6hdr icmp6;
	} reply = {};
	struct kbp_pseudo6 ph = {};
	__u8 quote[KBP_QUOTE_V6];
	__u32 sum;

	if (bpf_skb_load_bytes(skb, KBP_L3_OFF, quote, sizeof(quote)))
		return -1;

	__builtin_memcpy(ph.saddr, t->daddr, 16);
	__builtin_memcpy(ph.daddr, t->saddr, 16);
	ph.len = bpf_htonl(sizeof(reply.icmp6) + sizeof(quote));
	ph.next = IPPROTO_ICMPV6;
	reply.icmp6.icmp6_type = ICMPV6_DEST_UNREACH;
	reply.icmp6.icmp6_code = ICMPV6_PORT_UNREACH;
	sum = csum_add_bytes(&ph, sizeof(ph), 0);
	sum = csum_add_bytes(&reply.icmp6, sizeof(reply.icmp6), sum);
	reply.icmp6.icmp6_cksum = csum_fold(csum_add_bytes(quote, sizeof(quote), sum));
	reply.ip6.version = 6;
	reply.ip6.payload_len = bpf_htons(sizeof(reply.icmp6) + sizeof(quote));
	reply.ip6.nexthdr = IPPROTO_ICMPV6;
	reply.ip6.hop_limit = KBP_REPLY_TTL;
	__builtin_memcpy(&reply.ip6.saddr, t->daddr, 16);
	__builtin_memcpy(&reply.ip6.daddr, t->saddr, 16);

	if (bpf_skb_change_tail(skb, KBP_L3_OFF + sizeof(reply) + sizeof(quote), 0))
		return -1;
	if (bpf_skb_store_bytes(skb, KBP_L3_OFF, &reply, sizeof(reply), 0))
		return -1;
	return bpf_skb_store_bytes(skb, KBP_L3_OFF + sizeof(reply), quote, sizeof(quote), 0) ? -1
												: 0;
}

/* Turn the packet into its rejection: 0 when it is ready to send back, KBP_REJECT_SILENT
 * when nothing may be answered, -1 when a helper failed (the packet is then dropped). */
static __always_inline int reject_packet(struct __sk_buff *skb, const struct kbp_tuple *t)
{
	if (t->proto == IPPROTO_TCP)
		return reject_with_tcp_reset(skb, t);
	if (t->family == KBP_FAMILY_IPV4)
		return __reject_udp4(skb, t);
	return __reject_udp6(skb, t);
}

#endif /* KBP_LIB_REJECT_H */
