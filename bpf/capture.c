//go:build ignore

/* Pod-side capture: two tcx programs on the pod's own interface (eth0) inside
 * the pod's network namespace. Together they are an in-pod, iptables-free
 * TPROXY: outbound connections are re-injected from egress to ingress and
 * assigned to the tunnel's outbound listener, inbound plaintext connections
 * are assigned to the inbound listener, and packets of tunnel-owned sockets
 * are steered back to them. See docs/architecture.md. */

#include "include/maps.h"
#include "include/packet.h"

char __license[] SEC("license") = "GPL";

/* Load-time settings, set from Go through spec.Variables before loading. */
volatile const __u16 outbound_port = 15001;
volatile const __u16 inbound_port = 15006;
volatile const __u16 hbone_port = 15008;
volatile const __u32 mark_mask = 0xfff;
volatile const __u32 tunnel_mark = 0x539;   /* SO_MARK of every tunnel socket */
volatile const __u32 reinject_mark = 0x111; /* routed locally by the pod's fwmark rule */
volatile const __u8 probe_snat_v4[4] = {169, 254, 7, 127};
volatile const __u8 probe_snat_v6[16] = {0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37,
					 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};

/* Referenced so their BTF reaches bpf2go, which exports them to Go. */
const enum pod_flag *unused_pod_flag __attribute__((unused));
const enum verdict_reason *unused_verdict_reason __attribute__((unused));
const enum attach_mode *unused_attach_mode __attribute__((unused));

enum counter_field {
	CNT_OUTBOUND_CONN,
	CNT_INBOUND_CONN,
	CNT_STEERED,
	CNT_DROPPED,
	CNT_BYPASSED,
};

static __always_inline void count(__u32 reason, const struct pod_addr *pod, enum counter_field f)
{
	__u64 *r = bpf_map_lookup_elem(&rd_reasons, &reason);
	if (r)
		*r += 1;

	struct pod_counters *c = bpf_map_lookup_elem(&rd_pod_stats, pod);
	if (!c)
		return;
	switch (f) {
	case CNT_OUTBOUND_CONN:
		c->outbound_conns++;
		c->steered_packets++;
		break;
	case CNT_INBOUND_CONN:
		c->inbound_conns++;
		break;
	case CNT_STEERED:
		c->steered_packets++;
		break;
	case CNT_DROPPED:
		c->dropped_packets++;
		break;
	case CNT_BYPASSED:
		c->bypassed_packets++;
		break;
	}
}

static __always_inline int is_probe_addr(const struct pod_addr *a)
{
	struct pod_addr probe = {};

	if (is_v4(a)) {
		probe.addr[10] = 0xff;
		probe.addr[11] = 0xff;
		probe.addr[12] = probe_snat_v4[0];
		probe.addr[13] = probe_snat_v4[1];
		probe.addr[14] = probe_snat_v4[2];
		probe.addr[15] = probe_snat_v4[3];
	} else {
#pragma unroll
		for (int i = 0; i < 16; i++)
			probe.addr[i] = probe_snat_v6[i];
	}
	return addr_eq(a, &probe);
}

/* tunnel_owns reports whether a tunnel socket (not a listener) has the
 * packet's destination as its local end: the packet belongs to a connection
 * the tunnel terminates inside this pod. */
static __always_inline int tunnel_owns(struct __sk_buff *skb, struct tcp_pkt *p)
{
	struct bpf_sock *sk = lookup_tcp(skb, p);
	int owned;

	if (!sk)
		return 0;
	owned = sk->state != BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return owned;
}

/* steer re-injects an egress packet into the same interface's ingress. The
 * destination MAC becomes the interface's own (else the stack drops it as
 * PACKET_OTHERHOST) and the mark tells ingress and the fwmark rule that the
 * packet came from here, not from the wire. */
static __always_inline int steer(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__u8 own[ETH_ALEN];

	if ((void *)(eth + 1) > end)
		return TC_ACT_SHOT;
	__builtin_memcpy(own, eth->h_source, ETH_ALEN);
	if (bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), own, ETH_ALEN, 0) < 0)
		return TC_ACT_SHOT;
	skb->mark = reinject_mark;
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
}

/* assign_listener hands the packet to the tunnel listener on port, looked up
 * with the packet's tuple and the destination port replaced. Returns 0 when
 * assigned, or the reason to drop (fail closed: never pass it in plaintext). */
static __always_inline int assign_listener(struct __sk_buff *skb, struct tcp_pkt *p, __u16 port)
{
	struct bpf_sock *sk;
	long err;

	set_dport(p, port);
	sk = lookup_tcp(skb, p);
	if (!sk)
		return REASON_DROP_NO_LISTENER;
	if (sk->state != BPF_TCP_LISTEN) {
		bpf_sk_release(sk);
		return REASON_DROP_NO_LISTENER;
	}
	err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	if (err)
		return REASON_DROP_ASSIGN_FAILED;
	skb->mark = reinject_mark;
	return 0;
}

/* rd_pod_egress: tcx egress of the pod interface (pod -> world).
 *
 * Verdicts:
 *   TC_ACT_UNSPEC  (tcx next) for everything not ours: non-TCP, unenrolled
 *                  source, tunnel-marked sockets, excluded destinations, and
 *                  packets of connections the tunnel does not own;
 *   bpf_redirect   to this interface's ingress for a new outbound connection
 *                  (SYN without ACK) of an enrolled pod, and for any packet
 *                  whose tuple belongs to a tunnel socket (the app's side of a
 *                  captured or source-preserved connection);
 *   TC_ACT_SHOT    only if the Ethernet header cannot be rewritten.
 *
 * Why egress redirects instead of assigning: bpf_sk_assign only works on
 * ingress, so the packet takes one extra trip through this interface. Only a
 * SYN or a tunnel-owned tuple is steered; steering any other packet (say a
 * connection opened before the pod was enrolled) would break it. */
SEC("tcx/egress")
int rd_pod_egress(struct __sk_buff *skb)
{
	struct pod_settings *pod;
	struct tcp_pkt p = {};

	if (parse_tcp(skb, &p) < 0)
		return TC_ACT_UNSPEC;
	pod = bpf_map_lookup_elem(&rd_pods, &p.src);
	if (!pod)
		return TC_ACT_UNSPEC;

	if ((skb->mark & mark_mask) == tunnel_mark) {
		count(REASON_OUT_PASS_TUNNEL_MARK, &p.src, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (is_loopback(&p.dst) || is_probe_addr(&p.dst)) {
		count(REASON_OUT_PASS_EXCLUDED, &p.src, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (p.syn && !p.ack) {
		if (!(pod->flags & POD_CAPTURE_OUTBOUND))
			return TC_ACT_UNSPEC;
		count(REASON_OUT_SYN_STEERED, &p.src, CNT_OUTBOUND_CONN);
		return steer(skb);
	}
	if (tunnel_owns(skb, &p)) {
		count(REASON_OUT_TUNNEL_SOCKET, &p.src, CNT_STEERED);
		return steer(skb);
	}
	return TC_ACT_UNSPEC;
}

/* rd_pod_ingress: tcx ingress of the pod interface (world -> pod, plus the
 * packets rd_pod_egress re-injected).
 *
 * Verdicts for re-injected packets (they carry reinject_mark, which a packet
 * from another namespace cannot: the mark is scrubbed when crossing one):
 *   TC_ACT_OK      after bpf_sk_assign of an outbound SYN to the outbound
 *                  listener; other re-injected packets pass with the mark so
 *                  the fwmark rule delivers them locally to their socket;
 *   TC_ACT_SHOT    when the listener is missing (tunnel down): fail closed.
 * Verdicts for packets from the wire to an enrolled pod address:
 *   TC_ACT_SHOT    a source address of this same pod (spoofed: accept_local
 *                  is on for re-injection, so the stack would accept it);
 *   TC_ACT_UNSPEC  to the HBONE port, from the probe SNAT address, inbound
 *                  capture off, or a packet of an existing connection;
 *   TC_ACT_OK      after bpf_sk_assign of a new connection (SYN) to the
 *                  inbound plaintext listener;
 *   TC_ACT_SHOT    when that listener is missing: fail closed. */
SEC("tcx/ingress")
int rd_pod_ingress(struct __sk_buff *skb)
{
	struct pod_settings *pod, *src_pod;
	struct tcp_pkt p = {};
	int reason;

	if (parse_tcp(skb, &p) < 0)
		return TC_ACT_UNSPEC;

	if ((skb->mark & mark_mask) == reinject_mark) {
		pod = bpf_map_lookup_elem(&rd_pods, &p.src);
		if (!pod)
			return TC_ACT_UNSPEC;
		if (!(p.syn && !p.ack)) {
			count(REASON_IN_PASS_REINJECTED, &p.src, CNT_STEERED);
			return TC_ACT_OK;
		}
		reason = assign_listener(skb, &p, outbound_port);
		if (reason) {
			count(reason, &p.src, CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		count(REASON_IN_ASSIGN_OUTBOUND, &p.src, CNT_STEERED);
		return TC_ACT_OK;
	}

	pod = bpf_map_lookup_elem(&rd_pods, &p.dst);
	if (!pod)
		return TC_ACT_UNSPEC;
	src_pod = bpf_map_lookup_elem(&rd_pods, &p.src);
	if (src_pod && src_pod->pod_id == pod->pod_id) {
		count(REASON_DROP_SPOOFED, &p.dst, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	if (bpf_ntohs(pkt_dport(&p)) == hbone_port) {
		count(REASON_IN_PASS_HBONE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (is_probe_addr(&p.src)) {
		count(REASON_IN_PASS_PROBE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (!(pod->flags & POD_CAPTURE_INBOUND)) {
		count(REASON_IN_PASS_NO_CAPTURE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (!(p.syn && !p.ack) || tunnel_owns(skb, &p)) {
		/* the kernel's own demux finds the connection's socket */
		return TC_ACT_UNSPEC;
	}
	reason = assign_listener(skb, &p, inbound_port);
	if (reason) {
		count(reason, &p.dst, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	count(REASON_IN_ASSIGN_INBOUND, &p.dst, CNT_INBOUND_CONN);
	return TC_ACT_OK;
}
