/* Network namespace of a packet's device and of a socket, for the pod-side
 * and host-probe programs. Header-only, static __always_inline. */
#pragma once

#include <linux/bpf.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>

/* The kernel's sk_buff, net_device, sock_common, net and ns_common: only
 * the fields netns_ino and sk_netns_ino read, located at load time through
 * BTF (CO-RE). */
struct ns_common___rd {
	unsigned int inum;
} __attribute__((preserve_access_index));

struct net___rd {
	struct ns_common___rd ns;
} __attribute__((preserve_access_index));

struct net_device___rd {
	struct {
		struct net___rd *net;
	} nd_net;
} __attribute__((preserve_access_index));

struct sk_buff___rd {
	struct net_device___rd *dev;
} __attribute__((preserve_access_index));

struct sock_common___rd {
	struct {
		struct net___rd *net;
	} skc_net;
} __attribute__((preserve_access_index));

/* netns_ino is the inode number of the network namespace of the packet's
 * device (what stat(2) of /proc/<pid>/ns/net shows), 0 if it cannot be read.
 * The context is the kernel's sk_buff; as in tw_rcv_nxt (capture.c), its
 * address is read as a number first, and the fields with
 * bpf_probe_read_kernel. */
static __always_inline __u32 netns_ino(struct __sk_buff *skb)
{
	struct sk_buff___rd *k;

	if (bpf_probe_read_kernel(&k, sizeof(k), &skb) < 0)
		return 0;
	return BPF_CORE_READ(k, dev, nd_net.net, ns.inum);
}

/* sk_netns_ino is the inode number of the network namespace of a socket (a
 * struct bpf_sock is the kernel's struct sock, which starts with its
 * sock_common), 0 if it cannot be read. */
static __always_inline __u32 sk_netns_ino(struct bpf_sock *sk)
{
	struct sock_common___rd *k;

	if (bpf_probe_read_kernel(&k, sizeof(k), &sk) < 0)
		return 0;
	return BPF_CORE_READ(k, skc_net.net, ns.inum);
}
