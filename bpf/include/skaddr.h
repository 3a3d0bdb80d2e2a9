/* Addresses and ports of a socket as sock_ops and sk_msg programs see them,
 * in the data path's own forms: struct pod_addr's 16 bytes (IPv4-mapped) and
 * ports in network order. */
#pragma once

#include <linux/types.h>
#include <bpf/bpf_endian.h>

/* set_addr writes one end's address, IPv4 as ::ffff:a.b.c.d. */
static __always_inline void set_addr(__u8 *dst, __u32 family, __u32 ip4, const __u32 *ip6)
{
	__u32 *w = (__u32 *)dst;
	if (family == 2 /* AF_INET */) {
		w[0] = 0;
		w[1] = 0;
		w[2] = bpf_htonl(0xffff);
		w[3] = ip4;
	} else {
		w[0] = ip6[0];
		w[1] = ip6[1];
		w[2] = ip6[2];
		w[3] = ip6[3];
	}
}

/* net_port: remote_port is in network order; some kernels hand it in the
 * upper half. */
static __always_inline __u16 net_port(__u32 remote_port)
{
	return (remote_port & 0xffff) ? (__u16)remote_port : (__u16)(remote_port >> 16);
}
