/* Packet parsing and socket helpers for the pod-side programs. Header-only,
 * static __always_inline, so each entry program stays one flat function for
 * the verifier. */
#pragma once

#include <stddef.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_packet.h>
#include <linux/in.h>
#include <linux/in6.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "types.h"

/* How many IPv6 extension headers parse_tcp walks before it gives up. The
 * kernel itself walks any number, so a longer chain is dropped, not passed.
 * Eight is far more than any real packet carries (hop-by-hop, destination
 * options, routing, fragment, AH, destination options: six at most). */
#define IPV6_MAX_EXTHDRS 8

/* How many VLAN tags parse_tcp looks through to find the IP header of a
 * tagged frame (after the one the kernel strips before tc). Deeper stacks
 * are dropped without their addresses. */
#define VLAN_MAX_TAGS 4

#define IP_MF 0x2000
#define IP_OFFSET 0x1fff
#define IP6_MF 0x0001
#define IP6_OFFSET 0xfff8

/* A parsed packet: the addresses as soon as the IP header is read, and for
 * TCP enough to look up pods and sockets. */
struct tcp_pkt {
	struct pod_addr src;
	struct pod_addr dst;
	struct bpf_sock_tuple tuple; /* the packet's own tuple, network order */
	__u32 l4_off;                /* offset of the TCP header from the frame start */
	__u8 has_addrs;              /* src and dst are filled in */
	__u8 syn;
	__u8 ack;
	__u8 rst;
	__u8 v6;
	/* PARSE_UDP only: the UDP ports are in tuple (the header was whole),
	 * and, when nonzero, the verdict_reason a DNS query in this packet is
	 * dropped with: it could not be steered cleanly (a fragment, IPv4
	 * options, IPv6 extension headers, a source route, a stacked VLAN
	 * tag, a UDP header cut short). */
	__u8 has_ports;
	__u8 unclean;
};

/* What parse_tcp found. Anything else it returns is a verdict_reason: the
 * packet is IP but cannot be classified, and is dropped when it is to or from
 * an enrolled address. */
enum parse_result {
	PARSE_TCP = 0,    /* a whole TCP header, its tuple in p */
	PARSE_OTHER = -1, /* not IP, or IP whose payload is not TCP: not ours */
	PARSE_UDP = -2,   /* UDP (or the first fragment of it): its ports in p if
			   * has_ports; otherwise it is PARSE_OTHER to TCP */
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

/* is_link_local reports whether a is link-local: fe80::/10, or
 * 169.254.0.0/16 IPv4-mapped. Such an address is never enrolled
 * (selection.CheckPodAddr refuses it). */
static __always_inline int is_link_local(const struct pod_addr *a)
{
	if (is_v4(a))
		return a->addr[12] == 169 && a->addr[13] == 254;
	return a->addr[0] == 0xfe && (a->addr[1] & 0xc0) == 0x80;
}

static __always_inline int is_loopback(const struct pod_addr *a)
{
	static const struct pod_addr lo6 = {.addr = {[15] = 1}};
	if (is_v4(a) && a->addr[12] == 127)
		return 1;
	return addr_eq(a, &lo6);
}

/* IP protocol numbers linux/in.h does not name. */
#define IPPROTO_ETHERIP_RD 97 /* Ethernet-within-IP (RFC 3378) */
#define IPPROTO_HIP_RD 139    /* Host Identity Protocol (RFC 7401) */
#define IPPROTO_SHIM6_RD 140  /* Shim6 (RFC 5533) */

/* hides_tcp reports whether an IP protocol number can carry TCP that the
 * programs cannot see: encryption or compression (ESP, IPComp) and IP-in-IP,
 * GRE, MPLS-in-IP, L2TPv3 or Ethernet-in-IP encapsulation, which a
 * decapsulating device or SA in the pod (or any receiver off the node) would
 * deliver past the capture. */
static __always_inline int hides_tcp(__u8 proto)
{
	switch (proto) {
	case IPPROTO_ESP:
	case IPPROTO_COMP:
	case IPPROTO_IPIP:
	case IPPROTO_IPV6:
	case IPPROTO_GRE:
	case IPPROTO_MPLS:
	case IPPROTO_L2TP:
	case IPPROTO_ETHERNET:
	case IPPROTO_ETHERIP_RD:
		return 1;
	}
	return 0;
}

/* opaque_exthdr6 reports whether an IPv6 next header is an extension header
 * parse_ipv6 does not walk: the kernel has no input handler that walks past
 * it, but its format (RFC 6564) lets an upper-layer header follow, which
 * a receiver that implements it (off the node) would deliver: mobility,
 * HIP, Shim6, and the two experimental numbers (RFC 3692). */
static __always_inline int opaque_exthdr6(__u8 next)
{
	return next == IPPROTO_MH || next == IPPROTO_HIP_RD || next == IPPROTO_SHIM6_RD || next == 253 || next == 254;
}

/* may_hold_tcp6 reports whether what follows an IPv6 header with next
 * header next may be TCP, or hide it. */
static __always_inline int may_hold_tcp6(__u8 next)
{
	return next == IPPROTO_TCP || next == IPPROTO_HOPOPTS || next == IPPROTO_ROUTING || next == IPPROTO_DSTOPTS ||
	       next == IPPROTO_FRAGMENT || next == IPPROTO_AH || hides_tcp(next) || opaque_exthdr6(next);
}

/* set_ports puts a TCP or UDP header's ports (network order) into p's
 * tuple of its family. */
static __always_inline void set_ports(struct tcp_pkt *p, __be16 sport, __be16 dport)
{
	if (p->v6) {
		p->tuple.ipv6.sport = sport;
		p->tuple.ipv6.dport = dport;
	} else {
		p->tuple.ipv4.sport = sport;
		p->tuple.ipv4.dport = dport;
	}
}

/* read_tcp reads the TCP header at off into p. Returns PARSE_TCP or the
 * reason the header cannot be used. */
static __always_inline int read_tcp(struct __sk_buff *skb, struct tcp_pkt *p, __u32 off)
{
	struct tcphdr tcp;

	if (bpf_skb_load_bytes(skb, off, &tcp, sizeof(tcp)) < 0)
		return REASON_DROP_TRUNCATED;
	if (tcp.doff < 5)
		return REASON_DROP_MALFORMED;
	/* the options must be there too, as the kernel requires */
	if (off + tcp.doff * 4 > skb->len)
		return REASON_DROP_TRUNCATED;
	p->l4_off = off;
	p->syn = tcp.syn;
	p->ack = tcp.ack;
	p->rst = tcp.rst;
	set_ports(p, tcp.source, tcp.dest);
	return PARSE_TCP;
}

/* read_udp reads the UDP header at off into p for the DNS capture.
 * unclean is the reason a DNS query in it cannot be steered (0: it can).
 * Always PARSE_UDP: a header cut short only makes it unclean, with no
 * ports, since the programs cannot tell it is not a query to port 53. */
static __always_inline int read_udp(struct __sk_buff *skb, struct tcp_pkt *p, __u32 off, __u8 unclean)
{
	struct udphdr udp;

	p->l4_off = off;
	p->unclean = unclean;
	if (bpf_skb_load_bytes(skb, off, &udp, sizeof(udp)) < 0) {
		p->unclean = REASON_DROP_TRUNCATED;
		return PARSE_UDP;
	}
	p->has_ports = 1;
	set_ports(p, udp.source, udp.dest);
	return PARSE_UDP;
}

/* parse_ipv4 reads the IPv4 header at l3 (the end of the Ethernet header
 * and of any VLAN tags). */
static __always_inline int parse_ipv4(struct __sk_buff *skb, struct tcp_pkt *p, __u32 l3)
{
	struct iphdr ip;
	__u32 off;

	if (bpf_skb_load_bytes(skb, l3, &ip, sizeof(ip)) < 0)
		return REASON_DROP_TRUNCATED;
	map_v4(&p->src, ip.saddr);
	map_v4(&p->dst, ip.daddr);
	p->has_addrs = 1;
	p->v6 = 0;
	p->tuple.ipv4.saddr = ip.saddr;
	p->tuple.ipv4.daddr = ip.daddr;
	if (ip.version != 4 || ip.ihl < 5)
		return REASON_DROP_MALFORMED;
	off = l3 + ip.ihl * 4; /* IPv4 options are skipped, not read */
	if (off > skb->len)
		return REASON_DROP_TRUNCATED;

	/* Any fragment that may hold TCP: the first holds no complete
	 * segment and the others no header at all. */
	if (ip.frag_off & bpf_htons(IP_MF | IP_OFFSET)) {
		if (ip.protocol == IPPROTO_TCP || ip.protocol == IPPROTO_AH || hides_tcp(ip.protocol))
			return REASON_DROP_FRAGMENT;
		/* Only the first fragment holds the UDP header, and only
		 * with it can the datagram be put together. */
		if (ip.protocol == IPPROTO_UDP && !(ip.frag_off & bpf_htons(IP_OFFSET)))
			return read_udp(skb, p, off, REASON_DROP_FRAGMENT);
		return PARSE_OTHER;
	}
	if (ip.protocol == IPPROTO_AH) {
		struct ip_auth_hdr ah;

		if (bpf_skb_load_bytes(skb, off, &ah, sizeof(ah)) < 0)
			return REASON_DROP_TRUNCATED;
		if (ah.hdrlen < 1)
			return REASON_DROP_MALFORMED;
		off += (ah.hdrlen + 2) * 4;
		ip.protocol = ah.nexthdr;
		/* Only one AH is walked: a second (nested SAs) may cover TCP
		 * too, which a receiver with both SAs would deliver. */
		if (ip.protocol == IPPROTO_AH)
			return REASON_DROP_EXTHDR;
		if (ip.protocol == IPPROTO_UDP)
			return read_udp(skb, p, off, REASON_DROP_EXTHDR);
	}
	if (hides_tcp(ip.protocol))
		return REASON_DROP_EXTHDR;
	if (ip.protocol == IPPROTO_UDP)
		return read_udp(skb, p, off, ip.ihl > 5 ? REASON_DROP_IP_OPTIONS : 0);
	if (ip.protocol != IPPROTO_TCP)
		return PARSE_OTHER;
	return read_tcp(skb, p, off);
}

/* parse_ipv6 walks the extension header chain the way the kernel's input
 * path does (hop-by-hop, routing, destination options, fragment, AH) to find
 * the upper-layer protocol, at most IPV6_MAX_EXTHDRS headers deep. The IPv6
 * header is at l3. */
static __always_inline int parse_ipv6(struct __sk_buff *skb, struct tcp_pkt *p, __u32 l3)
{
	struct ipv6hdr ip6;
	__u32 off = l3 + sizeof(struct ipv6hdr);
	__u8 next;

	if (bpf_skb_load_bytes(skb, l3, &ip6, sizeof(ip6)) < 0)
		return REASON_DROP_TRUNCATED;
	__builtin_memcpy(p->src.addr, &ip6.saddr, 16);
	__builtin_memcpy(p->dst.addr, &ip6.daddr, 16);
	__builtin_memcpy(p->tuple.ipv6.saddr, &ip6.saddr, 16);
	__builtin_memcpy(p->tuple.ipv6.daddr, &ip6.daddr, 16);
	p->has_addrs = 1;
	p->v6 = 1;
	if (ip6.version != 6)
		return REASON_DROP_MALFORMED;
	/* An IPv4-mapped address is IPv4's map key: in an IPv6 header it would
	 * be taken for an IPv4 pod's. No host has one (the kernel drops IPv6
	 * from a mapped source, and the pod's fwmark route is what would
	 * deliver to a mapped destination). */
	if (is_v4(&p->src) || is_v4(&p->dst))
		return REASON_DROP_MALFORMED;
	next = ip6.nexthdr;

	for (int i = 0; i < IPV6_MAX_EXTHDRS; i++) {
		struct ipv6_opt_hdr h;

		switch (next) {
		case IPPROTO_TCP:
			return read_tcp(skb, p, off);
		case IPPROTO_ROUTING: {
			struct ipv6_rt_hdr rt;

			/* With segments left, the destination address is
			 * the next hop, not where the packet is going (any
			 * user can send such TCP: IPV6_RTHDR with a segment
			 * routing header needs no capability). */
			if (bpf_skb_load_bytes(skb, off, &rt, sizeof(rt)) < 0)
				return REASON_DROP_TRUNCATED;
			if (rt.segments_left) {
				if (may_hold_tcp6(rt.nexthdr))
					return REASON_DROP_SOURCE_ROUTE;
				if (rt.nexthdr == IPPROTO_UDP)
					return read_udp(skb, p, off + (rt.hdrlen + 1) * 8, REASON_DROP_SOURCE_ROUTE);
				return PARSE_OTHER;
			}
			off += (rt.hdrlen + 1) * 8;
			next = rt.nexthdr;
			break;
		}
		case IPPROTO_HOPOPTS:
		case IPPROTO_DSTOPTS:
			if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)) < 0)
				return REASON_DROP_TRUNCATED;
			off += (h.hdrlen + 1) * 8;
			next = h.nexthdr;
			break;
		case IPPROTO_AH:
			if (bpf_skb_load_bytes(skb, off, &h, sizeof(h)) < 0)
				return REASON_DROP_TRUNCATED;
			if (h.hdrlen < 1)
				return REASON_DROP_MALFORMED;
			off += (h.hdrlen + 2) * 4;
			next = h.nexthdr;
			break;
		case IPPROTO_FRAGMENT: {
			struct frag_hdr {
				__u8 nexthdr;
				__u8 reserved;
				__be16 frag_off;
				__be32 identification;
			} fh;

			if (bpf_skb_load_bytes(skb, off, &fh, sizeof(fh)) < 0)
				return REASON_DROP_TRUNCATED;
			off += sizeof(fh);
			next = fh.nexthdr;
			/* An atomic fragment (offset 0, no more) is a whole
			 * packet: walk on. A real fragment whose payload may
			 * be TCP cannot be classified. */
			if (fh.frag_off & bpf_htons(IP6_MF | IP6_OFFSET)) {
				if (may_hold_tcp6(next))
					return REASON_DROP_FRAGMENT;
				if (next == IPPROTO_UDP && !(fh.frag_off & bpf_htons(IP6_OFFSET)))
					return read_udp(skb, p, off, REASON_DROP_FRAGMENT);
				return PARSE_OTHER;
			}
			break;
		}
		case IPPROTO_UDP:
			/* the kernel delivers UDP after extension headers, but
			 * a DNS query is steered only without them */
			return read_udp(skb, p, off, i ? REASON_DROP_EXTHDR : 0);
		default:
			if (hides_tcp(next) || opaque_exthdr6(next))
				return REASON_DROP_EXTHDR;
			/* UDP, ICMPv6, no next header (59), and protocols the
			 * kernel has no handler for: not TCP. */
			return PARSE_OTHER;
		}
		if (off > skb->len)
			return REASON_DROP_TRUNCATED;
	}
	/* IPV6_MAX_EXTHDRS headers walked: what follows the last is still
	 * read (the loop looks at a header only before walking it). */
	if (next == IPPROTO_TCP)
		return read_tcp(skb, p, off);
	if (next == IPPROTO_UDP)
		return read_udp(skb, p, off, REASON_DROP_EXTHDR);
	if (!may_hold_tcp6(next))
		return PARSE_OTHER;
	return REASON_DROP_EXTHDR;
}

/* is_vlan reports whether an ethertype is a VLAN tag: 802.1Q, 802.1ad, or
 * one of the pre-standard QinQ types. */
static __always_inline int is_vlan(__be16 proto)
{
	return proto == bpf_htons(ETH_P_8021Q) || proto == bpf_htons(ETH_P_8021AD) || proto == bpf_htons(ETH_P_QINQ1) ||
	       proto == bpf_htons(ETH_P_QINQ2) || proto == bpf_htons(ETH_P_QINQ3);
}

/* parse_tcp fills p from an Ethernet frame. It returns PARSE_TCP for a TCP
 * packet it can classify, PARSE_OTHER for what is not TCP (non-IP frames,
 * UDP, ICMP, ...), and otherwise the verdict_reason to drop it with: an IP
 * packet that may carry TCP but cannot be classified (truncated or malformed
 * headers, TCP in fragments, a chain too long, a payload it cannot see into).
 * p->has_addrs says whether the addresses were read. Headers are read with
 * bpf_skb_load_bytes, so they need not be in the linear part of the skb.
 *
 * The kernel takes one VLAN tag off before tc runs (into skb metadata), so a
 * tag still in the frame is a second one: the kernel may take that off too
 * after tc (a priority tag, VID 0, is) and deliver what it carries, which tc
 * never classified. Such a frame is REASON_DROP_VLAN when it carries IP that
 * is or may be TCP, with the inner addresses read (up to VLAN_MAX_TAGS
 * tags; deeper, without them); tagged UDP, ICMP and non-IP frames are
 * PARSE_OTHER as untagged ones are.
 *
 * UDP (and the first fragment of a UDP datagram) is PARSE_UDP, which the
 * TCP capture treats as PARSE_OTHER; read_udp says whether a DNS query in
 * it could be steered cleanly. */
static __always_inline int parse_tcp(struct __sk_buff *skb, struct tcp_pkt *p)
{
	__u32 l3 = ETH_HLEN;
	__be16 proto;
	int tagged = 0, ret;

	if (bpf_skb_load_bytes(skb, offsetof(struct ethhdr, h_proto), &proto, sizeof(proto)) < 0)
		return PARSE_OTHER;
	for (int i = 0; i < VLAN_MAX_TAGS && is_vlan(proto); i++) {
		/* A tag: TCI, then the ethertype of what follows. */
		if (bpf_skb_load_bytes(skb, l3 + 2, &proto, sizeof(proto)) < 0)
			return REASON_DROP_VLAN;
		l3 += 4;
		tagged = 1;
	}
	if (is_vlan(proto))
		return REASON_DROP_VLAN;
	if (proto == bpf_htons(ETH_P_IP))
		ret = parse_ipv4(skb, p, l3);
	else if (proto == bpf_htons(ETH_P_IPV6))
		ret = parse_ipv6(skb, p, l3);
	else
		return PARSE_OTHER;
	if (tagged && ret == PARSE_UDP) {
		p->unclean = REASON_DROP_VLAN;
		return ret;
	}
	if (tagged && ret != PARSE_OTHER)
		return REASON_DROP_VLAN;
	return ret;
}

static __always_inline __be16 pkt_dport(const struct tcp_pkt *p)
{
	return p->v6 ? p->tuple.ipv6.dport : p->tuple.ipv4.dport;
}

/* lookup_udp finds the UDP socket the tuple addresses in this namespace:
 * a connected one, else the most specific bound one. */
static __always_inline struct bpf_sock *lookup_udp(struct __sk_buff *skb, struct tcp_pkt *p)
{
	if (p->v6)
		return bpf_sk_lookup_udp(skb, &p->tuple, sizeof(p->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
	return bpf_sk_lookup_udp(skb, &p->tuple, sizeof(p->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
}

static __always_inline void set_dport(struct tcp_pkt *p, __u16 port)
{
	if (p->v6)
		p->tuple.ipv6.dport = bpf_htons(port);
	else
		p->tuple.ipv4.dport = bpf_htons(port);
}

/* lookup_tcp finds the socket the tuple addresses in this namespace, an
 * established one first (time-wait and request sockets included), else a
 * listener. The size argument must be a constant for the verifier, hence the
 * branch. */
static __always_inline struct bpf_sock *lookup_tcp(struct __sk_buff *skb, struct tcp_pkt *p)
{
	if (p->v6)
		return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
	return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
}
