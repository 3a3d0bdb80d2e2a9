/* Packet parsing and address rewriting for the host-probe programs.
 * Header-only, static __always_inline. */
#pragma once

#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "packet.h"

#define IP4_OFF ETH_HLEN
#define IP4_SADDR_OFF (ETH_HLEN + offsetof(struct iphdr, saddr))
#define IP4_DADDR_OFF (ETH_HLEN + offsetof(struct iphdr, daddr))
#define IP4_CSUM_OFF (ETH_HLEN + offsetof(struct iphdr, check))
#define IP6_SADDR_OFF (ETH_HLEN + offsetof(struct ipv6hdr, saddr))
#define IP6_DADDR_OFF (ETH_HLEN + offsetof(struct ipv6hdr, daddr))
#define TCP_CSUM_OFF offsetof(struct tcphdr, check)

/* A parsed TCP packet: addresses (IPv4-mapped for IPv4), ports in network
 * order, and where the TCP header starts. */
struct host_pkt {
	struct pod_addr src;
	struct pod_addr dst;
	__u32 l4_off;
	__be16 sport;
	__be16 dport;
	__u8 v6;
	__u8 syn;
	__u8 ack;
};

/* parse_host_pkt fills p from an Ethernet frame carrying IPv4 or IPv6 TCP.
 * Returns -1 for anything else, and for IPv4 fragments and IPv6 extension
 * headers: rewriting only part of a fragmented packet would break it. */
static __always_inline int parse_host_pkt(struct __sk_buff *skb, struct host_pkt *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct tcphdr *tcp;

	if ((void *)(eth + 1) > end)
		return -1;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl < 5)
			return -1;
		if (ip->frag_off & bpf_htons(0x3fff)) /* MF or an offset */
			return -1;
		p->l4_off = ETH_HLEN + ip->ihl * 4;
		tcp = (void *)ip + ip->ihl * 4;
		if ((void *)(tcp + 1) > end)
			return -1;
		map_v4(&p->src, ip->saddr);
		map_v4(&p->dst, ip->daddr);
		p->v6 = 0;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_TCP)
			return -1;
		p->l4_off = ETH_HLEN + sizeof(*ip6);
		tcp = (void *)(ip6 + 1);
		if ((void *)(tcp + 1) > end)
			return -1;
		__builtin_memcpy(p->src.addr, &ip6->saddr, 16);
		__builtin_memcpy(p->dst.addr, &ip6->daddr, 16);
		p->v6 = 1;
	} else {
		return -1;
	}
	p->sport = tcp->source;
	p->dport = tcp->dest;
	p->syn = tcp->syn;
	p->ack = tcp->ack;
	return 0;
}

/* read_addrs reads the source and destination of an IPv4 or IPv6 packet,
 * whatever it carries (fragments and extension headers included), behind
 * up to VLAN_MAX_TAGS VLAN tags still in the frame: the kernel keeps one
 * tag in the skb, a second stays in the frame at tc, and the pod's kernel
 * strips priority tags (VID 0) one after the other and delivers what they
 * carry. Read at the fixed offsets only, a frame a neighbour with a packet
 * socket tagged twice passed the checks with any source, the probe SNAT
 * address included (the pod-side capture drops tagged TCP, not the rest).
 * Returns -1 for other frames, deeper stacks (which the pod-side capture
 * drops unread on an enrolled pod's interface) and packets too short to
 * hold the addresses. */
static __always_inline int read_addrs(struct __sk_buff *skb, struct pod_addr *src, struct pod_addr *dst, __u8 *v6)
{
	__u32 l3 = ETH_HLEN;
	__be16 proto;

	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &proto, sizeof(proto)) < 0)
		return -1;
	for (int i = 0; i < VLAN_MAX_TAGS && is_vlan(proto); i++) {
		/* a tag: TCI, then the ethertype of what follows */
		if (bpf_skb_load_bytes(skb, l3 + 2, &proto, sizeof(proto)) < 0)
			return -1;
		l3 += 4;
	}
	if (proto == bpf_htons(ETH_P_IP)) {
		__be32 a[2];

		if (bpf_skb_load_bytes(skb, l3 + offsetof(struct iphdr, saddr), a, sizeof(a)) < 0)
			return -1;
		map_v4(src, a[0]);
		map_v4(dst, a[1]);
		*v6 = 0;
		return 0;
	}
	if (proto == bpf_htons(ETH_P_IPV6)) {
		if (bpf_skb_load_bytes(skb, l3 + offsetof(struct ipv6hdr, saddr), src->addr, 16) < 0 ||
		    bpf_skb_load_bytes(skb, l3 + offsetof(struct ipv6hdr, daddr), dst->addr, 16) < 0)
			return -1;
		*v6 = 1;
		return 0;
	}
	return -1;
}

/* rewrite_addr replaces the IPv4 or IPv6 address at addr_off (source or
 * destination) with to, fixing the checksums incrementally. Offloads are on
 * for veths, so most packets are CHECKSUM_PARTIAL: the TCP checksum field then
 * holds the pseudo-header sum, which BPF_F_PSEUDO_HDR updates correctly; for
 * fully checksummed packets the same call updates the full sum.
 *
 * skb->csum (CHECKSUM_COMPLETE): for IPv4 the address and IP checksum changes
 * cancel out and the L4 helper accounts for the TCP checksum change. IPv6 has
 * no header checksum, so the address store itself is accounted for with
 * BPF_F_RECOMPUTE_CSUM (this works on every kernel, unlike BPF_F_IPV6).
 *
 * Returns 0, or -1 once the packet may be half rewritten: drop it then. The
 * helpers change the packet, so no packet pointer survives this call. */
static __always_inline int rewrite_addr(struct __sk_buff *skb, const struct host_pkt *p, __u32 addr_off,
					const struct pod_addr *from, const struct pod_addr *to)
{
	__u32 csum_off = p->l4_off + TCP_CSUM_OFF;

	if (p->v6) {
		__be32 old[4], new[4];
		__s64 diff;

		__builtin_memcpy(old, from->addr, 16);
		__builtin_memcpy(new, to->addr, 16);
		diff = bpf_csum_diff(old, sizeof(old), new, sizeof(new), 0);
		if (diff < 0)
			return -1;
		if (bpf_l4_csum_replace(skb, csum_off, 0, diff, BPF_F_PSEUDO_HDR) < 0)
			return -1;
		if (bpf_skb_store_bytes(skb, addr_off, new, sizeof(new), BPF_F_RECOMPUTE_CSUM) < 0)
			return -1;
		return 0;
	}

	__be32 old4, new4;
	__builtin_memcpy(&old4, &from->addr[12], 4);
	__builtin_memcpy(&new4, &to->addr[12], 4);
	if (bpf_l4_csum_replace(skb, csum_off, old4, new4, BPF_F_PSEUDO_HDR | sizeof(new4)) < 0)
		return -1;
	if (bpf_l3_csum_replace(skb, IP4_CSUM_OFF, old4, new4, sizeof(new4)) < 0)
		return -1;
	if (bpf_skb_store_bytes(skb, addr_off, &new4, sizeof(new4), 0) < 0)
		return -1;
	return 0;
}
