/* Packet parsing and socket helpers for the pod-side programs. Header-only,
 * static __always_inline, so each entry program stays one flat function for
 * the verifier. */
#pragma once

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "types.h"

/* A parsed TCP packet: enough to look up pods and sockets. */
struct tcp_pkt {
	struct pod_addr src;
	struct pod_addr dst;
	struct bpf_sock_tuple tuple; /* the packet's own tuple, network order */
	__u8 syn;
	__u8 ack;
	__u8 v6;
};

static __always_inline void map_v4(struct pod_addr *a, __be32 ip)
{
	__builtin_memset(a, 0, sizeof(*a));
	a->addr[10] = 0xff;
	a->addr[11] = 0xff;
	__builtin_memcpy(&a->addr[12], &ip, 4);
}

static __always_inline int addr_eq(const struct pod_addr *a, const struct pod_addr *b)
{
	const __u64 *x = (const __u64 *)a->addr;
	const __u64 *y = (const __u64 *)b->addr;
	return x[0] == y[0] && x[1] == y[1];
}

/* is_v4 reports whether a is IPv4-mapped (::ffff:a.b.c.d). All ten
 * leading bytes must be zero: an IPv6 address may well have 0xffff in
 * bytes 10-11 (the default probe SNAT address does). */
static __always_inline int is_v4(const struct pod_addr *a)
{
	const __u64 *w = (const __u64 *)a->addr;
	return w[0] == 0 && a->addr[8] == 0 && a->addr[9] == 0 && a->addr[10] == 0xff && a->addr[11] == 0xff;
}

static __always_inline int is_loopback(const struct pod_addr *a)
{
	static const struct pod_addr lo6 = {.addr = {[15] = 1}};
	if (is_v4(a) && a->addr[12] == 127)
		return 1;
	return addr_eq(a, &lo6);
}

/* parse_tcp fills p from an Ethernet frame carrying IPv4 or IPv6 TCP.
 * Returns 0 on success, -1 for anything else (which the programs pass).
 * IPv6 extension headers are not walked: such packets are passed. */
static __always_inline int parse_tcp(struct __sk_buff *skb, struct tcp_pkt *p)
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
		/* fragments other than the first carry no TCP header */
		if (ip->frag_off & bpf_htons(0x1fff))
			return -1;
		tcp = (void *)ip + ip->ihl * 4;
		if ((void *)(tcp + 1) > end)
			return -1;
		map_v4(&p->src, ip->saddr);
		map_v4(&p->dst, ip->daddr);
		p->tuple.ipv4.saddr = ip->saddr;
		p->tuple.ipv4.daddr = ip->daddr;
		p->tuple.ipv4.sport = tcp->source;
		p->tuple.ipv4.dport = tcp->dest;
		p->v6 = 0;
		/* read flags here, while the verifier still knows tcp's bounds */
		p->syn = tcp->syn;
		p->ack = tcp->ack;
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end || ip6->nexthdr != IPPROTO_TCP)
			return -1;
		tcp = (void *)(ip6 + 1);
		if ((void *)(tcp + 1) > end)
			return -1;
		__builtin_memcpy(p->src.addr, &ip6->saddr, 16);
		__builtin_memcpy(p->dst.addr, &ip6->daddr, 16);
		__builtin_memcpy(p->tuple.ipv6.saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->tuple.ipv6.daddr, &ip6->daddr, 16);
		p->tuple.ipv6.sport = tcp->source;
		p->tuple.ipv6.dport = tcp->dest;
		p->v6 = 1;
		p->syn = tcp->syn;
		p->ack = tcp->ack;
	} else {
		return -1;
	}
	return 0;
}

static __always_inline __be16 pkt_dport(const struct tcp_pkt *p)
{
	return p->v6 ? p->tuple.ipv6.dport : p->tuple.ipv4.dport;
}

static __always_inline void set_dport(struct tcp_pkt *p, __u16 port)
{
	if (p->v6)
		p->tuple.ipv6.dport = bpf_htons(port);
	else
		p->tuple.ipv4.dport = bpf_htons(port);
}

/* lookup_tcp finds the socket the tuple addresses in this namespace, an
 * established one first, else a listener. The size argument must be a
 * constant for the verifier, hence the branch. */
static __always_inline struct bpf_sock *lookup_tcp(struct __sk_buff *skb, struct tcp_pkt *p)
{
	if (p->v6)
		return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
	return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
}
