/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Checksum helpers: incremental L3/L4 updates when NAT rewrites an address or a port,
 * and full sums for the headers REJECT builds from scratch.
 */
#ifndef KBP_LIB_CSUM_H
#define KBP_LIB_CSUM_H

#include "lib/common.h"
#include "lib/parse.h"

/* Offsets of the L4 checksum fields, relative to the L4 header. */
#define KBP_TCP_CHECK_OFF 16
#define KBP_UDP_CHECK_OFF 6

/* bcc declares bpf_csum_diff as returning int, which sign-extends sums >= 2^31 into
 * "errors"; the kernel returns the 32-bit sum zero-extended in an s64, so declare that. */
#define __kbp_csum_diff ((__s64(*)(void *, __u64, void *, __u64, __u64))BPF_FUNC_csum_diff)

/* Fold a 32-bit one's-complement sum into the 16-bit checksum field value. */
static __always_inline __sum16 csum_fold(__u32 sum)
{
	sum = (sum & 0xffff) + (sum >> 16);
	sum = (sum & 0xffff) + (sum >> 16);
	return (__sum16)~sum;
}

static __always_inline __u32 csum_l4_offset(const struct kbp_tuple *t)
{
	return t->l4_off + (t->proto == IPPROTO_TCP ? KBP_TCP_CHECK_OFF : KBP_UDP_CHECK_OFF);
}

/* A zero UDP checksum means "none" (IPv4, RFC 768) and must stay zero; a rewrite that
 * sums to zero is sent as 0xffff instead. */
static __always_inline __u64 csum_l4_flags(const struct kbp_tuple *t)
{
	return t->proto == IPPROTO_UDP ? BPF_F_MARK_MANGLED_0 : 0;
}

static __always_inline __u32 csum_add(__u32 sum, __u32 addend)
{
	sum += addend;
	return sum + (sum < addend);
}

/* What a checksum must absorb when an address changes from `from` to `to` (RFC 1624:
 * add ~from, add to), as an unfolded sum. */
static __always_inline __u32 csum_addr_diff(const struct kbp_tuple *t, const __be32 *from,
					    const __be32 *to)
{
	__u32 diff = csum_add(~from[0], to[0]);

	if (t->family == KBP_FAMILY_IPV6) {
#pragma unroll
		for (int i = 1; i < 4; i++)
			diff = csum_add(csum_add(diff, ~from[i]), to[i]);
	}
	return diff;
}

static __always_inline __u32 csum_port_diff(__be16 from, __be16 to)
{
	return (__u16)~from + (__u32)to;
}

/* Apply a difference to the L4 checksum through the helper, which alone knows whether
 * the skb's checksum is complete, partial (offloaded: the field then holds only the
 * pseudo-header sum, so data changes must not touch it) or none. `pseudo`: the change
 * is in the pseudo-header (addresses), not in the L4 bytes (ports). */
static __always_inline int csum_l4_apply(struct __sk_buff *skb, const struct kbp_tuple *t,
					 __u32 diff, int pseudo)
{
	__u64 flags = csum_l4_flags(t) | (pseudo ? BPF_F_PSEUDO_HDR : 0);

	/* Size 0 in the flags: `to` is a precomputed difference and `from` must be 0. */
	return bpf_l4_csum_replace(skb, csum_l4_offset(t), 0, diff, flags);
}

/* The IPv4 header checksum after its addresses changed by `diff`: that checksum covers
 * only the header, so it is updated in place without the skb's checksum state. */
static __always_inline __sum16 csum_ipv4_header_update(__sum16 check, __u32 diff)
{
	return csum_fold(csum_add((__u16)~check, diff));
}

/* One's-complement sum of `len` bytes (a multiple of 4) on the stack, plus `seed`. */
static __always_inline __u32 csum_add_bytes(void *buf, __u32 len, __u32 seed)
{
	return (__u32)__kbp_csum_diff(0, 0, buf, len, seed);
}

#endif /* KBP_LIB_CSUM_H */
