/* SPDX-License-Identifier: Apache-2.0 */
/*
 * What every datapath library needs: the kernel's protocol headers, the pinned maps, and
 * a few constants. Compiled by bcc, which provides the helper declarations (bpf_redirect,
 * bpf_l4_csum_replace, bpf_htons, ...) and turns `map.lookup(&key)` into map calls (in
 * the main text only: see lib/maps.h).
 */
#ifndef KBP_LIB_COMMON_H
#define KBP_LIB_COMMON_H

#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/in6.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/tcp.h>
#include <uapi/linux/udp.h>
#include <uapi/linux/icmp.h>
#include <uapi/linux/icmpv6.h>
#include <uapi/linux/pkt_cls.h>

#include "kbp_maps.h"

#ifndef __always_inline
#define __always_inline inline __attribute__((always_inline))
#endif /* __always_inline */

#define KBP_NS_PER_SEC 1000000000ULL

/* Conntrack and affinity times: CLOCK_MONOTONIC (what bpf_ktime_get_ns() reads, and
 * Python's time.monotonic_ns()) at tick resolution, for about half the cost of the fine
 * clock (13 vs 30 ns measured here); seconds-long timeouts need no better. Kernel 5.11+. */
static __u64 (*kbp_now)(void) = (void *)BPF_FUNC_ktime_get_coarse_ns;

/* TCP flag bits as they sit in byte 13 of the TCP header. */
#define KBP_TCP_FIN 0x01
#define KBP_TCP_SYN 0x02
#define KBP_TCP_RST 0x04
#define KBP_TCP_ACK 0x10

/* Address families of struct bpf_fib_lookup (the socket headers are not included). */
#define KBP_AF_INET 2
#define KBP_AF_INET6 10

/* An address in the ABI's form (IPv4 in word 0, the other words 0) folded to one word,
 * the XOR of its four: how kbp_ct_gate's slots take addresses (an IPv4 address folds to
 * itself). */
static __always_inline __u32 kbp_addr_fold(const __be32 *addr)
{
	return addr[0] ^ addr[1] ^ addr[2] ^ addr[3];
}

/* Hop limit of the RST / ICMP replies we originate: Linux's net.ipv4.ip_default_ttl. */
#define KBP_REPLY_TTL 64

#endif /* KBP_LIB_COMMON_H */
