//go:build ignore

/* Host-probe SNAT: two tcx programs on the node-side end of each enrolled
 * pod's veth, in the node's network namespace. Kubelet probes leave the node
 * through that veth; their source becomes a fixed SNAT address that the
 * pod-side programs never capture, so probes reach the app even where
 * plaintext is otherwise refused. The pod's replies get the node's address
 * back. Like Istio's `-m owner --socket-exists ... -j SNAT`, but conntrack-free:
 * a bounded LRU map remembers each SNATed connection. See docs/architecture.md. */

#include "include/hostprobe_maps.h"
#include "include/hostprobe.h"
#include "include/netns.h"

char __license[] SEC("license") = "GPL";

/* Load-time settings, set from Go through spec.Variables before loading. */
volatile const __u32 mark_mask = 0xfff;
volatile const __u32 tunnel_mark = 0x539; /* SO_MARK of every tunnel socket */
volatile const __u8 snat_v4[4] = {169, 254, 7, 127};
volatile const __u8 snat_v6[16] = {0xfd, 0x16, 0x92, 0x54, 0x71, 0x27, 0x13, 0x37,
				   0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
/* The cgroup v2 id of the cgroup above every pod's (kubelet's "kubepods"),
 * 0 when unknown. A SYN whose socket lives below it comes from a process of a
 * pod sharing the node's network namespace (hostNetwork), not from kubelet:
 * it is no probe. */
volatile const __u64 pods_cgroup = 0;

/* Cgroup levels looked at for pods_cgroup; kubelet's pod cgroups sit a few
 * levels down (kubepods.slice/kubepods-burstable.slice/...). */
#define MAX_CGROUP_LEVEL 16

enum snat_counter {
	CNT_CONN,
	CNT_SNAT,
	CNT_REPLY,
	CNT_TUNNEL_MARKED,
	CNT_ERROR,
};

static __always_inline void count(__u32 pod_id, enum snat_counter f)
{
	struct snat_counters *c = bpf_map_lookup_elem(&rd_probe_stats, &pod_id);

	if (!c)
		return;
	switch (f) {
	case CNT_CONN:
		c->conns++;
		break;
	case CNT_SNAT:
		c->snat_packets++;
		break;
	case CNT_REPLY:
		c->reply_packets++;
		break;
	case CNT_TUNNEL_MARKED:
		c->tunnel_marked++;
		break;
	case CNT_ERROR:
		c->errors++;
		break;
	}
}

/* count_reason counts a drop in the pod-side programs' rd_reasons. */
static __always_inline void count_reason(__u32 reason)
{
	__u64 *n = bpf_map_lookup_elem(&rd_reasons, &reason);

	if (n)
		*n += 1;
}

/* snat_addr is the SNAT address of the packet's family, IPv4-mapped for IPv4
 * like every address in these maps. */
static __always_inline void snat_addr(struct pod_addr *a, int v6)
{
	if (v6) {
#pragma unroll
		for (int i = 0; i < 16; i++)
			a->addr[i] = snat_v6[i];
		return;
	}
	__builtin_memset(a, 0, sizeof(*a));
	a->addr[10] = 0xff;
	a->addr[11] = 0xff;
	a->addr[12] = snat_v4[0];
	a->addr[13] = snat_v4[1];
	a->addr[14] = snat_v4[2];
	a->addr[15] = snat_v4[3];
}

/* node_sent reports whether this node's own stack sent the packet: it was
 * received on no device (a packet routed through the node, bridged from
 * another pod's veth or redirected by a tc program was, and keeps that
 * ingress ifindex), and a socket it carries is in this device's namespace,
 * the node's: a veth keeps skb->sk when a packet crosses into another
 * namespace, so a pod's packet may still carry the pod's socket. Every
 * packet of a node connection qualifies, those the kernel sends for it
 * without a full socket (a TIME_WAIT ACK, a reset) included. */
static __always_inline int node_sent(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;
	__u32 ino;

	if (skb->ingress_ifindex)
		return 0;
	if (!sk)
		return 1;
	ino = sk_netns_ino(sk);
	return ino && ino == netns_ino(skb);
}

/* skb_from_pod reports whether the packet's socket is a process's below
 * pods_cgroup (a hostNetwork pod's). A level past the socket's own cgroup
 * has no ancestor, and the helper returns 0 there. */
static __always_inline int skb_from_pod(struct __sk_buff *skb)
{
	if (!pods_cgroup)
		return 0;
	for (int level = 1; level <= MAX_CGROUP_LEVEL; level++) {
		__u64 id = bpf_skb_ancestor_cgroup_id(skb, level);

		if (id == pods_cgroup)
			return 1;
		if (!id)
			return 0;
	}
	return 0;
}

/* The kernel's sock, cgroup and kernfs_node: only the fields sk_from_pod
 * reads, located at load time through BTF (CO-RE). A cgroup's self is its
 * first member, so the parent of its self is its parent cgroup's self. */
struct kernfs_node___rd {
	__u64 id;
} __attribute__((preserve_access_index));

struct cgroup_subsys_state___rd {
	struct cgroup_subsys_state___rd *parent;
} __attribute__((preserve_access_index));

struct cgroup___rd {
	struct cgroup_subsys_state___rd self;
	struct kernfs_node___rd *kn;
} __attribute__((preserve_access_index));

struct sock___rd {
	struct {
		struct cgroup___rd *cgroup;
	} sk_cgrp_data;
} __attribute__((preserve_access_index));

/* sk_from_pod is skb_from_pod for a full socket found by lookup. tc
 * programs may not call bpf_sk_ancestor_cgroup_id, so the socket's cgroup
 * v2 and its parents are read as in sk_netns_ino; a kernel whose sock has no
 * cgroup pointer (before 5.15) reads as none. */
static __always_inline int sk_from_pod(struct bpf_sock *sk)
{
	struct sock___rd *k;
	struct cgroup___rd *cg;

	if (!pods_cgroup || !bpf_core_field_exists(struct sock___rd, sk_cgrp_data.cgroup))
		return 0;
	if (bpf_probe_read_kernel(&k, sizeof(k), &sk) < 0)
		return 0;
	cg = BPF_CORE_READ(k, sk_cgrp_data.cgroup);
	for (int level = 0; level <= MAX_CGROUP_LEVEL && cg; level++) {
		if (BPF_CORE_READ(cg, kn, id) == pods_cgroup)
			return 1;
		cg = (struct cgroup___rd *)BPF_CORE_READ(cg, self.parent);
	}
	return 0;
}

/* reply_tuple fills t with the tuple of the pod's answer to p (from the
 * pod to the node): looked up in the node's namespace, it finds the node's
 * socket of p's connection. */
static __always_inline void reply_tuple(struct bpf_sock_tuple *t, const struct host_pkt *p)
{
	if (p->v6) {
		__builtin_memcpy(t->ipv6.saddr, p->dst.addr, 16);
		__builtin_memcpy(t->ipv6.daddr, p->src.addr, 16);
		t->ipv6.sport = p->dport;
		t->ipv6.dport = p->sport;
	} else {
		__builtin_memcpy(&t->ipv4.saddr, &p->dst.addr[12], 4);
		__builtin_memcpy(&t->ipv4.daddr, &p->src.addr[12], 4);
		t->ipv4.sport = p->dport;
		t->ipv4.dport = p->sport;
	}
}

/* node_connecting reports whether the node holds the connecting socket of
 * this SYN's connection: a socket of its namespace in SYN_SENT from the
 * SYN's source address and port to its destination. A SYN without a socket
 * is the node's only if it is a copy of such a socket's SYN, which a bridge
 * flooded. The node's kernel builds SYNs without a socket for others too:
 * netfilter's SYNPROXY (iptables or nftables) answers a remote client's
 * handshake itself, then opens the connection to the pod for it in a fresh
 * packet with the client's source, sent with neither a socket nor an
 * ingress device. The lookup is the one for the pod's answer (from the pod
 * to the node's socket), so it finds the node's socket only: like Istio's
 * --socket-exists, and unlike it per packet, a node connection whose SYN the
 * node's own netfilter rewrote on the way out (a Service address DNATed in
 * OUTPUT) has no socket of the packet's tuple, so a flooded copy of it is
 * not translated; its copy with the socket, on a bridge that knows the
 * pod, is. */
static __always_inline int node_connecting(struct __sk_buff *skb, const struct host_pkt *p, int *from_pod)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	int ok;

	reply_tuple(&t, p);
	if (p->v6)
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_sk_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	ok = sk->state == BPF_TCP_SYN_SENT;
	if (ok)
		*from_pod = sk_from_pod(sk);
	bpf_sk_release(sk);
	return ok;
}

/* node_holds reports whether the node has a socket of p's connection, in
 * any state but listening (a time-wait or request socket included): whether
 * a probe with p's tuple may still be open. A NAT entry outlives its probe,
 * and without such a socket it is no probe's any more. */
static __always_inline int node_holds(struct __sk_buff *skb, const struct host_pkt *p)
{
	struct bpf_sock_tuple t = {};
	struct bpf_sock *sk;
	int held;

	reply_tuple(&t, p);
	if (p->v6)
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv6), BPF_F_CURRENT_NETNS, 0);
	else
		sk = bpf_skc_lookup_tcp(skb, &t, sizeof(t.ipv4), BPF_F_CURRENT_NETNS, 0);
	if (!sk)
		return 0;
	held = sk->state != BPF_TCP_LISTEN;
	bpf_sk_release(sk);
	return held;
}

/* node_syn reports whether the node's stack sent this SYN (node_sent): from
 * a full socket of the node's namespace, or, without a socket, as the copy
 * of such a socket's SYN that a bridge flooded (the bridge clones the node's
 * packet for every port but one, and a clone carries no socket) while that
 * socket is still connecting (node_connecting). Packets of pods and other
 * nodes were received on a device, and a tc redirect keeps that ingress
 * ifindex; the node's refragmenting of a forwarded packet makes fragments,
 * which parse_host_pkt refuses; a SYN netfilter builds for a remote client
 * (SYNPROXY) has no socket of its tuple on the node. */
static __always_inline int node_syn(struct __sk_buff *skb, const struct host_pkt *p, int *from_pod)
{
	struct bpf_sock *sk = skb->sk;

	*from_pod = 0;
	if (sk) {
		if (!bpf_sk_fullsock(sk) || !node_sent(skb))
			return 0;
		*from_pod = skb_from_pod(skb);
		return 1;
	}
	return node_sent(skb) && node_connecting(skb, p, from_pod);
}

/* own_veth reports whether the packet leaves by the host veth of pod_id, the
 * pod it is addressed to, and not by another pod's veth that a bridge
 * flooded it to (rd_probe_veths). */
static __always_inline int own_veth(struct __sk_buff *skb, __u32 pod_id)
{
	__u32 ifindex = skb->ifindex;
	__u32 *owner = bpf_map_lookup_elem(&rd_probe_veths, &ifindex);

	return owner && *owner == pod_id;
}

/* forget_stale deletes the NAT entry of key that an earlier probe from the
 * node address node left: a SYN the node sends untranslated starts a
 * connection on that tuple, which the entry would translate. An entry of
 * another node address is another connection's, perhaps a live probe's (the
 * key holds no node address: the pod's replies show none), and stays: a
 * hostNetwork pod that took a live probe's port on another of the node's
 * addresses deleted it, and the probe failed. */
static __always_inline void forget_stale(struct nat_key *key, const struct pod_addr *node)
{
	struct nat_entry *e = bpf_map_lookup_elem(&rd_probe_nat, key);

	if (e && addr_eq(&e->node, node))
		bpf_map_delete_elem(&rd_probe_nat, key);
}

/* spoofed_probe reports (and counts) a packet to an enrolled pod whose
 * source already is the SNAT address, of any protocol: this program sees
 * packets before it translates them, so such a packet was not translated
 * here. It would otherwise pass the pod-side capture as a kubelet probe. */
static __always_inline int spoofed_probe(struct __sk_buff *skb)
{
	struct pod_addr src, dst, snat;
	__u8 v6;

	if (read_addrs(skb, &src, &dst, &v6) < 0)
		return 0;
	snat_addr(&snat, v6);
	if (!addr_eq(&src, &snat) || !bpf_map_lookup_elem(&rd_pods, &dst))
		return 0;
	count_reason(REASON_DROP_PROBE_SPOOFED);
	return 1;
}

/* rd_host_egress: tcx egress of the node-side veth of an enrolled pod
 * (node -> pod: packets the node sends or forwards to the pod).
 *
 * Verdicts:
 *   TC_ACT_UNSPEC  (tcx next) always when the packet is fine, rewritten or
 *                  not, so programs attached after this one still run:
 *     - a SYN without ACK that the node sent (node_syn: from a full
 *       socket of its namespace, or a bridge's flooded copy without one
 *       while that socket is connecting),
 *       without the tunnel mark, to an enrolled pod address (rd_pods),
 *       leaving by that pod's own host veth (rd_probe_veths), gets an
 *       rd_probe_nat entry and its source rewritten to the SNAT address;
 *     - a later packet of such a connection that the node's stack sent
 *       (node_sent, from no socket of a process below pods_cgroup; the entry exists and its node address is the packet's
 *       source) and that leaves by the veth its SYN left by is rewritten
 *       the same way;
 *     - a SYN the node sent that is not translated (tunnel mark, an
 *       address not enrolled, or a socket of a process below pods_cgroup,
 *       counted as host_pod_not_probe) deletes the entry of its tuple that
 *       an earlier probe from its node address may have left (nothing else
 *       deletes them; an entry of another node address is left alone);
 *     - everything else passes untouched: non-TCP, forwarded traffic (no
 *       socket of the node's namespace and an ingress device: other pods,
 *       whether routed or bridged, other nodes), the copies of a node
 *       packet that a bridge which forgot where the pod is floods to the
 *       other pods' veths, SYNs the node's netfilter builds for a remote
 *       client (SYNPROXY: no socket of the node has their tuple),
 *       tunnel-marked sockets, connections
 *       the pod opened to the node (the node answers with SYN-ACK, which
 *       never creates an entry), unenrolled pods, IPv6 extension headers;
 *   TC_ACT_SHOT    a packet of any protocol to an enrolled pod whose source
 *                  already is the SNAT address (counted as drop_probe_spoofed:
 *                  only this program may give a packet that source), a
 *                  packet with the node's end of a probe connection that the
 *                  node did not send (a frame a pod on the bridge forged
 *                  while the node holds the connection's socket, or a
 *                  hostNetwork pod's raw or packet socket sent; also
 *                  drop_probe_spoofed; a forwarded packet whose tuple only
 *                  a stale entry has, of a connection the node masqueraded,
 *                  passes and the entry is forgotten), a SYN
 *                  whose NAT entry cannot be stored (the SYN is retried), or
 *                  a packet whose rewrite failed half-way (it is corrupt).
 *
 * Why only a SYN starts SNAT: it makes the rule apply to connections the node
 * opens, as Istio's nat-table rule does through conntrack, and a connection
 * is SNATed from its first packet to its last or not at all. */
SEC("tcx/egress")
int rd_host_egress(struct __sk_buff *skb)
{
	struct host_pkt p = {};
	struct nat_key key = {};
	struct nat_entry ent = {};
	struct pod_addr snat;

	if (spoofed_probe(skb))
		return TC_ACT_SHOT;
	if (parse_host_pkt(skb, &p) < 0)
		return TC_ACT_UNSPEC;
	key.pod = p.dst;
	key.pod_port = p.dport;
	key.node_port = p.sport;
	snat_addr(&snat, p.v6);

	if (p.syn && !p.ack) {
		struct pod_settings *pod;
		int from_pod;

		if (!node_syn(skb, &p, &from_pod))
			return TC_ACT_UNSPEC;
		pod = bpf_map_lookup_elem(&rd_pods, &p.dst);
		if (!pod) {
			/* a connection the node opens untranslated stays so:
			 * an entry an earlier probe left for its tuple would
			 * translate its later packets */
			forget_stale(&key, &p.src);
			return TC_ACT_UNSPEC;
		}
		/* A copy a bridge flooded to another pod's port: the copy on
		 * the pod's own veth is the one translated. */
		if (!own_veth(skb, pod->pod_id))
			return TC_ACT_UNSPEC;
		if ((skb->mark & mark_mask) == tunnel_mark) {
			forget_stale(&key, &p.src);
			count(pod->pod_id, CNT_TUNNEL_MARKED);
			return TC_ACT_UNSPEC;
		}
		if (from_pod) {
			/* a hostNetwork pod's process: a client like any
			 * other, whose plaintext the pod's capture judges */
			forget_stale(&key, &p.src);
			count_reason(REASON_HOST_POD_NOT_PROBE);
			return TC_ACT_UNSPEC;
		}
		ent.pod_id = pod->pod_id;
		ent.node = p.src;
		ent.ifindex = skb->ifindex;
		if (bpf_map_update_elem(&rd_probe_nat, &key, &ent, BPF_ANY) < 0) {
			count(ent.pod_id, CNT_ERROR);
			return TC_ACT_SHOT;
		}
		count(ent.pod_id, CNT_CONN);
	} else {
		struct nat_entry *e = bpf_map_lookup_elem(&rd_probe_nat, &key);

		if (!e || !addr_eq(&e->node, &p.src))
			return TC_ACT_UNSPEC;
		/* The node's address and port are no proof: a pod on the
		 * node's bridge can send a frame with them, and a hostNetwork
		 * pod's raw or packet socket is one of the node's namespace
		 * (skb_from_pod, as for the SYN). Passed as it is, it would
		 * meet no socket in the pod, whose reset the node's
		 * connection would take for its peer's. */
		if (!node_sent(skb)) {
			/* Forwarded with the node's address: a forgery while the
			 * probe is open, else another connection that the node
			 * masqueraded to its own address (kube-proxy's NodePort
			 * traffic) and whose port an old probe used. The entry
			 * outlived that probe; forgotten, the connection passes
			 * as it would without it. */
			if (node_holds(skb, &p)) {
				count_reason(REASON_DROP_PROBE_SPOOFED);
				return TC_ACT_SHOT;
			}
			bpf_map_delete_elem(&rd_probe_nat, &key);
			return TC_ACT_UNSPEC;
		}
		if (skb_from_pod(skb)) {
			count_reason(REASON_DROP_PROBE_SPOOFED);
			return TC_ACT_SHOT;
		}
		/* a copy flooded to another pod's port */
		if (e->ifindex != skb->ifindex)
			return TC_ACT_UNSPEC;
		ent = *e;
	}

	if (rewrite_addr(skb, &p, p.v6 ? IP6_SADDR_OFF : IP4_SADDR_OFF, &p.src, &snat) < 0) {
		count(ent.pod_id, CNT_ERROR);
		return TC_ACT_SHOT;
	}
	count(ent.pod_id, CNT_SNAT);
	/* tells the pod-side capture this source was given here */
	bpf_set_hash(skb, HASH_PROBE_SNAT);
	return TC_ACT_UNSPEC;
}

/* to_snat reports (and counts) a packet to the SNAT address, of any
 * protocol, that rd_host_ingress does not translate: the address is no
 * peer, and the node would route the packet on, off the node (the pod-side
 * capture never captures that address). */
static __always_inline int to_snat(struct __sk_buff *skb)
{
	struct pod_addr src, dst, snat;
	__u8 v6;

	if (read_addrs(skb, &src, &dst, &v6) < 0)
		return 0;
	snat_addr(&snat, v6);
	if (!addr_eq(&dst, &snat))
		return 0;
	count_reason(REASON_DROP_PROBE_UNMATCHED);
	return 1;
}

/* rd_host_ingress: tcx ingress of the node-side veth of an enrolled pod
 * (pod -> node and everything else the pod sends).
 *
 * Verdicts:
 *   TC_ACT_UNSPEC  (tcx next) always when the packet is fine: a TCP packet
 *                  to the SNAT address whose connection is in rd_probe_nat
 *                  gets the node's address back as its destination; all other
 *                  packets not to the SNAT address pass untouched. The NAT
 *                  entry is not checked against rd_pods, so a probe
 *                  connection open while its pod is unenrolled still gets
 *                  its replies;
 *   TC_ACT_SHOT    a packet of a probe connection the NAT map knows that
 *                  arrives on another veth than the one its SYN left by
 *                  (counted as drop_probe_spoofed): another pod forging the
 *                  probed pod's address, whose packet would otherwise reach
 *                  kubelet's probe socket as the pod's answer;
 *   TC_ACT_SHOT    any other packet to the SNAT address (counted as
 *                  drop_probe_unmatched): the pod's own connection to it,
 *                  which the pod-side capture leaves uncaptured, a reply to
 *                  a probe whose entry is gone (evicted, or forgotten when
 *                  the map was replaced), any other protocol. The address is
 *                  no peer, and the node would route such a packet off the
 *                  node, in plaintext;
 *   TC_ACT_SHOT    when a rewrite failed half-way (the packet is corrupt).
 *
 * Why here: the pod routes replies to the SNAT address via its default
 * gateway, so they cross this veth before the node's stack sees them. */
SEC("tcx/ingress")
int rd_host_ingress(struct __sk_buff *skb)
{
	struct host_pkt p = {};
	struct nat_key key = {};
	struct nat_entry *e;
	struct pod_addr snat, node;
	__u32 pod_id;

	if (parse_host_pkt(skb, &p) < 0)
		return to_snat(skb) ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	snat_addr(&snat, p.v6);
	if (!addr_eq(&p.dst, &snat))
		return TC_ACT_UNSPEC;
	key.pod = p.src;
	key.pod_port = p.sport;
	key.node_port = p.dport;
	e = bpf_map_lookup_elem(&rd_probe_nat, &key);
	if (!e) {
		count_reason(REASON_DROP_PROBE_UNMATCHED);
		return TC_ACT_SHOT;
	}
	if (e->ifindex != skb->ifindex) {
		count_reason(REASON_DROP_PROBE_SPOOFED);
		return TC_ACT_SHOT;
	}
	node = e->node;
	pod_id = e->pod_id;

	if (rewrite_addr(skb, &p, p.v6 ? IP6_DADDR_OFF : IP4_DADDR_OFF, &snat, &node) < 0) {
		count(pod_id, CNT_ERROR);
		return TC_ACT_SHOT;
	}
	count(pod_id, CNT_REPLY);
	return TC_ACT_UNSPEC;
}
