//go:build ignore

/* Optional acceleration between a pod's app and the tunnel (Merbridge's
 * idea): both ends of a captured connection are sockets in the same pod
 * namespace, so their payload can move socket to socket without a trip
 * through the TCP stack, the pod interface and the re-injection. Off unless
 * SOCKOPS_ACCELERATION is set. */

#include <linux/bpf.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>
#include "include/maps.h"
#include "include/sockops.h"

char __license[] SEC("license") = "GPL";

/* Connected local sockets of enrolled pods, by their own key. The kernel
 * drops a socket from the map when it closes. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_sock_pairs SEC(".maps");

/* The keys of rd_sock_pairs whose socket is still open. sk_msg cannot look
 * a socket up in a sockhash, and redirecting to a missing key drops the
 * data, so it checks here first. Entries leave when the socket closes. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_sock_open SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct accel_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_accel_stats SEC(".maps");

const struct accel_counters *unused_accel_counters __attribute__((unused));

/* Context fields are read one 32-bit word at a time (volatile): the
 * verifier refuses the 64-bit loads the compiler would merge them into. */

static __always_inline struct accel_counters *stats(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&rd_accel_stats, &zero);
}

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

/* remote_port is in network order; some kernels hand it in the upper half. */
static __always_inline __u16 net_port(__u32 remote_port)
{
	return (remote_port & 0xffff) ? (__u16)remote_port : (__u16)(remote_port >> 16);
}

static __always_inline int enrolled(const __u8 *addr)
{
	struct pod_addr a;
	__builtin_memcpy(a.addr, addr, 16);
	return bpf_map_lookup_elem(&rd_pods, &a) != NULL;
}

/* rd_sockops: cgroup sock_ops, on every TCP socket of the cgroup.
 * Verdict: none (sock_ops only observes). When a connection is established
 * and one of its ends is an enrolled pod address, the socket joins
 * rd_sock_pairs (which makes rd_sk_msg run on its sends) and rd_sock_open;
 * when it closes, it leaves rd_sock_open (the kernel drops it from the
 * sockhash itself). */
SEC("sockops")
int rd_sockops(struct bpf_sock_ops *skops)
{
	struct sock_key key = {};
	__u32 ip6l[4], ip6r[4];
	__u32 op = skops->op;
	__u8 one = 1;

	if (op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB &&
	    op != BPF_SOCK_OPS_STATE_CB)
		return 1;
	if (skops->family != 2 && skops->family != 10)
		return 1;
	ip6l[0] = *(volatile __u32 *)&skops->local_ip6[0];
	ip6l[1] = *(volatile __u32 *)&skops->local_ip6[1];
	ip6l[2] = *(volatile __u32 *)&skops->local_ip6[2];
	ip6l[3] = *(volatile __u32 *)&skops->local_ip6[3];
	ip6r[0] = *(volatile __u32 *)&skops->remote_ip6[0];
	ip6r[1] = *(volatile __u32 *)&skops->remote_ip6[1];
	ip6r[2] = *(volatile __u32 *)&skops->remote_ip6[2];
	ip6r[3] = *(volatile __u32 *)&skops->remote_ip6[3];
	set_addr(key.local, skops->family, skops->local_ip4, ip6l);
	set_addr(key.remote, skops->family, skops->remote_ip4, ip6r);
	key.lport = bpf_htons((__u16)skops->local_port);
	key.rport = net_port(skops->remote_port);
	key.netns = bpf_get_netns_cookie(skops);

	if (op == BPF_SOCK_OPS_STATE_CB) {
		/* args[1] is the new state: the socket can no longer take data. */
		if (skops->args[1] == BPF_TCP_CLOSE)
			bpf_map_delete_elem(&rd_sock_open, &key);
		return 1;
	}
	if (!enrolled(key.local) && !enrolled(key.remote))
		return 1;
	if (bpf_sock_hash_update(skops, &rd_sock_pairs, &key, BPF_ANY) == 0) {
		bpf_map_update_elem(&rd_sock_open, &key, &one, BPF_ANY);
		bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
		struct accel_counters *c = stats();
		if (c)
			c->sockets++;
	}
	return 1;
}

/* rd_sk_msg: sk_msg verdict on every send of a socket in rd_sock_pairs.
 * Verdicts: the message is redirected into the ingress queue of the
 * connection's other end when that end is a socket of the same namespace in
 * the map (the app and the tunnel of a captured connection); SK_PASS (the
 * normal path) otherwise, for instance before the other end is established. */
SEC("sk_msg")
int rd_sk_msg(struct sk_msg_md *msg)
{
	struct sock_key peer = {};
	struct accel_counters *c = stats();
	__u32 ip6l[4], ip6r[4];

	if (msg->family != 2 && msg->family != 10)
		return SK_PASS;
	ip6l[0] = *(volatile __u32 *)&msg->local_ip6[0];
	ip6l[1] = *(volatile __u32 *)&msg->local_ip6[1];
	ip6l[2] = *(volatile __u32 *)&msg->local_ip6[2];
	ip6l[3] = *(volatile __u32 *)&msg->local_ip6[3];
	ip6r[0] = *(volatile __u32 *)&msg->remote_ip6[0];
	ip6r[1] = *(volatile __u32 *)&msg->remote_ip6[1];
	ip6r[2] = *(volatile __u32 *)&msg->remote_ip6[2];
	ip6r[3] = *(volatile __u32 *)&msg->remote_ip6[3];
	/* The peer's key: our remote end is its local end. */
	set_addr(peer.local, msg->family, msg->remote_ip4, ip6r);
	set_addr(peer.remote, msg->family, msg->local_ip4, ip6l);
	peer.lport = net_port(msg->remote_port);
	peer.rport = bpf_htons((__u16)msg->local_port);
	peer.netns = bpf_get_netns_cookie(msg);

	/* Redirecting to a missing peer would drop the data: look first. */
	if (!bpf_map_lookup_elem(&rd_sock_open, &peer)) {
		if (c)
			c->passed++;
		return SK_PASS;
	}
	if (c) {
		c->redirected++;
		c->redirected_bytes += msg->size;
	}
	return bpf_msg_redirect_hash(msg, &rd_sock_pairs, &peer, BPF_F_INGRESS);
}
