//go:build ignore

/* Pod-side capture: two tcx programs on the pod's own interface (eth0) inside
 * the pod's network namespace. Together they are an in-pod, iptables-free
 * TPROXY: outbound connections are re-injected from egress to ingress and
 * assigned to the tunnel's outbound listener, inbound plaintext connections
 * are assigned to the inbound listener, and packets of tunnel-owned sockets
 * are steered back to them. See docs/architecture.md. */

#include "include/maps.h"
#include "include/packet.h"
#include "include/netns.h"
#include "include/skaddr.h"

char __license[] SEC("license") = "GPL";

/* Load-time settings, set from Go through spec.Variables before loading. */
volatile const __u16 outbound_port = 15001;
volatile const __u16 inbound_port = 15006;
volatile const __u16 hbone_port = 15008;
volatile const __u16 dns_port = 15053; /* the tunnel's DNS socket in each pod, bound to [::] */
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
	CNT_REASON_ONLY, /* a socket, not a packet: the pod's packet counters stay */
};

static __always_inline void count(__u32 reason, const struct pod_addr *pod, enum counter_field f)
{
	__u64 *r = bpf_map_lookup_elem(&rd_reasons, &reason);
	struct pod_counters *c;

	if (r)
		*r += 1;
	if (f == CNT_REASON_ONLY)
		return;
	c = bpf_map_lookup_elem(&rd_pod_stats, pod);
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
	default:
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

/* rd_captured marks the app sockets whose outbound connection egress
 * steered to the tunnel: it lives and dies with the socket. A packet of
 * such a socket that no tunnel socket owns any more (the tunnel reset the
 * connection, and the app sent before the RST reached its socket) would
 * otherwise leave the pod in plaintext as if it were a connection from
 * before enrollment. */
struct {
	__uint(type, BPF_MAP_TYPE_SK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_captured SEC(".maps");

/* rd_dialled bridges the gap rd_captured leaves for the app sockets the
 * tunnel dials (inbound, from the client's own address): such a socket is
 * accepted, so no steered SYN marks it, and its first full-socket packet may
 * come after the tunnel socket is gone (a connection revoked as soon as it
 * was dialled, a server that speaks first). Its SYN-ACK, sent by a request
 * socket that cannot carry storage, leaves the tuple here; the socket's
 * first packet moves the mark to rd_captured and removes the entry. LRU:
 * entries of handshakes whose socket never sent (reset before it was
 * accepted) age out. */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, struct dialled_key);
	__type(value, __u8);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_dialled SEC(".maps");

static __always_inline void dialled_key_of(const struct tcp_pkt *p, struct dialled_key *k)
{
	k->src = p->src;
	k->dst = p->dst;
	if (p->v6) {
		k->sport = p->tuple.ipv6.sport;
		k->dport = p->tuple.ipv6.dport;
	} else {
		k->sport = p->tuple.ipv4.sport;
		k->dport = p->tuple.ipv4.dport;
	}
}

/* app_socket returns the full socket that sent an egress packet, or NULL
 * (a packet the kernel sends on a socket's behalf, a reset or a time-wait
 * ACK, comes from a socket of its own). */
static __always_inline struct bpf_sock *app_socket(struct __sk_buff *skb)
{
	struct bpf_sock *sk = skb->sk;

	if (!sk)
		return NULL;
	return bpf_sk_fullsock(sk);
}

/* mark_captured marks the sender of a steered SYN as captured; 0 when it
 * could not (no memory), and the SYN must not go on. A SYN with no socket
 * of its own (none is sent so) has nothing to mark. */
static __always_inline int mark_captured(struct __sk_buff *skb)
{
	struct bpf_sock *sk = app_socket(skb);

	if (!sk)
		return 1;
	return bpf_sk_storage_get(&rd_captured, sk, 0, BPF_SK_STORAGE_GET_F_CREATE) != NULL;
}

/* keep_captured marks the sender of an egress packet that a tunnel socket
 * owns as captured, whichever way its connection reached the tunnel (an
 * accepted app socket the tunnel dialled has no steered SYN); a SYN-ACK,
 * whose request socket cannot be marked, leaves its tuple in rd_dialled
 * for the socket the handshake makes. 0 when it could not (no memory): the
 * packet must not go on, TCP sends it again. */
static __always_inline int keep_captured(struct __sk_buff *skb, const struct tcp_pkt *p)
{
	struct bpf_sock *sk = app_socket(skb);
	struct dialled_key k = {};
	__u8 one = 1;

	dialled_key_of(p, &k);
	if (p->syn && p->ack && bpf_map_update_elem(&rd_dialled, &k, &one, BPF_ANY) < 0)
		return 0;
	if (!sk || bpf_sk_storage_get(&rd_captured, sk, 0, 0))
		return 1;
	if (!bpf_sk_storage_get(&rd_captured, sk, 0, BPF_SK_STORAGE_GET_F_CREATE))
		return 0;
	bpf_map_delete_elem(&rd_dialled, &k); /* the socket carries the mark now */
	return 1;
}

/* was_captured reports whether the sender of an egress packet is an app
 * socket whose connection was captured: marked, or the socket of a
 * handshake the tunnel dialled (rd_dialled), which gets the mark now so
 * that its retransmissions are judged alike whatever the LRU keeps. */
static __always_inline int was_captured(struct __sk_buff *skb, const struct tcp_pkt *p)
{
	struct bpf_sock *sk = app_socket(skb);
	struct dialled_key k = {};

	if (!sk)
		return 0;
	if (bpf_sk_storage_get(&rd_captured, sk, 0, 0))
		return 1;
	dialled_key_of(p, &k);
	if (!bpf_map_lookup_elem(&rd_dialled, &k))
		return 0;
	if (bpf_sk_storage_get(&rd_captured, sk, 0, BPF_SK_STORAGE_GET_F_CREATE))
		bpf_map_delete_elem(&rd_dialled, &k);
	return 1;
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

/* netns_pod returns the settings of the enrolled pod the packet's interface
 * belongs to (the programs run only on pods' interfaces, inside their
 * namespaces), and in *owner the address its counters go to; NULL when the
 * namespace has no rd_pod_netns entry, or the address it names has no
 * rd_pods entry of that pod (the kill switch). Only packets that are not
 * to or from an enrolled address, and drops, pay for it. */
static __always_inline struct pod_settings *netns_pod(struct __sk_buff *skb, struct pod_addr *owner)
{
	__u32 ino = netns_ino(skb);
	struct pod_settings *pod;
	struct pod_netns *ns;

	if (!ino)
		return NULL;
	ns = bpf_map_lookup_elem(&rd_pod_netns, &ino);
	if (!ns)
		return NULL;
	pod = bpf_map_lookup_elem(&rd_pods, &ns->addr);
	if (!pod || pod->pod_id != ns->pod_id)
		return NULL;
	*owner = ns->addr;
	return pod;
}

/* not_for_host reports whether an ingress frame is one the stack will not
 * take as its own (a frame the bridge flooded, multicast, broadcast): TCP
 * and IP reassembly accept only PACKET_HOST. */
static __always_inline int not_for_host(struct __sk_buff *skb, int ingress)
{
	return ingress && skb->pkt_type != PACKET_HOST;
}

/* drop_unparsed is the verdict for an IP packet parse_tcp could not
 * classify (reason is why): dropped when its source or destination is
 * enrolled, on an enrolled pod's interface whatever its addresses (a
 * fragment to the pod's link-local address is the pod's too; on ingress,
 * if the frame is for this host), and when not even its addresses could be
 * read; passed otherwise, as traffic that is not the mesh's. The drop is
 * the pod's whose interface it is, whatever the addresses say (a sender on
 * the wire picks its source: charged to it, a neighbour's forged fragments
 * "from" another pod went to that pod's counters, and frames whose
 * addresses cannot be read to none); by address only off such an
 * interface. */
static __always_inline int drop_unparsed(struct __sk_buff *skb, const struct tcp_pkt *p, __u32 reason, int ingress)
{
	static const struct pod_addr none = {};
	const struct pod_addr *by_addr = &none;
	struct pod_addr owner;
	int on_pod = netns_pod(skb, &owner) != NULL;

	if (p->has_addrs) {
		if (bpf_map_lookup_elem(&rd_pods, &p->src))
			by_addr = &p->src;
		else if (bpf_map_lookup_elem(&rd_pods, &p->dst))
			by_addr = &p->dst;
		else if (!on_pod || not_for_host(skb, ingress))
			return TC_ACT_UNSPEC;
	}
	count(reason, on_pod ? &owner : by_addr, CNT_DROPPED);
	return TC_ACT_SHOT;
}

/* own_source reports (and counts as drop_spoofed) an IPv4 packet from the
 * wire whose source is an enrolled address of the pod whose interface it
 * arrives on: any protocol but TCP, and TCP to an address that is not
 * enrolled (TCP to an enrolled address gets the check in rd_pod_ingress,
 * by the destination's pod). The loader turns accept_local on for
 * re-injection, and with it the kernel takes such a packet, which it
 * refuses as a martian otherwise: a sender on the wire could pose as the
 * pod to its own sockets. IPv6 has no such check to restore. The pod's own multicast and
 * broadcast, looped back to its interface, are PACKET_LOOPBACK. Only a
 * packet from an enrolled address pays for the netns lookup. */
static __always_inline int own_source(struct __sk_buff *skb, const struct tcp_pkt *p)
{
	struct pod_settings *src_pod, *pod;
	struct pod_addr owner;

	if (!p->has_addrs || p->v6 || skb->pkt_type == PACKET_LOOPBACK)
		return 0;
	src_pod = bpf_map_lookup_elem(&rd_pods, &p->src);
	if (!src_pod)
		return 0;
	pod = netns_pod(skb, &owner);
	if (!pod || pod->pod_id != src_pod->pod_id)
		return 0;
	count(REASON_DROP_SPOOFED, &owner, CNT_DROPPED);
	return 1;
}

/* foreign_src reports (and counts as drop_foreign_src, for the pod whose
 * interface it is) an egress packet from an enrolled address of another pod
 * than the one whose interface it leaves (src_pod is that address's
 * settings), when the interface's pod has flag on. IP_FREEBIND and
 * IPV6_FREEBIND need no capability, and for IPv6 the kernel sends from the
 * address so bound: without this the packet was judged by the other pod's
 * settings and charged to it, so a DNS query of a pod with DNS capture
 * "from" a neighbour without it left uncaptured, and a SYN was counted as
 * the neighbour's connection. Off an enrolled pod's interface (no
 * rd_pod_netns entry, or its kill switch) nothing changes. Only the
 * verdicts that read the source's settings pay for the lookup. */
static __always_inline int foreign_src(struct __sk_buff *skb, const struct pod_settings *src_pod, __u32 flag)
{
	struct pod_settings *pod;
	struct pod_addr owner;

	pod = netns_pod(skb, &owner);
	if (!pod || pod->pod_id == src_pod->pod_id || !(pod->flags & flag))
		return 0;
	count(REASON_DROP_FOREIGN_SRC, &owner, CNT_DROPPED);
	return 1;
}

/* foreign_dst reports (and counts as drop_foreign_dst, for the pod whose
 * interface it is) a SYN (or a SYN cookie's ACK, cookie_ack) from the wire
 * to an enrolled address of another pod than the one whose interface it
 * arrives on: a neighbour routed that pod's address via this pod's MAC. The inbound listener is transparent and
 * the assignment does not look at the address, so the kernel, which drops
 * such a packet as not local, would instead hand it to this pod's tunnel,
 * which would then serve another pod's address. A frame the host would not
 * take (one the bridge flooded) is left to the kernel, which drops it
 * uncounted. Only a SYN, or an ACK cookie_ack is about to assign, pays
 * for the lookup. */
static __always_inline int foreign_dst(struct __sk_buff *skb, const struct pod_settings *dst_pod)
{
	struct pod_settings *pod;
	struct pod_addr owner;

	if (not_for_host(skb, 1))
		return 0;
	pod = netns_pod(skb, &owner);
	if (!pod || pod->pod_id == dst_pod->pod_id)
		return 0;
	count(REASON_DROP_FOREIGN_DST, &owner, CNT_DROPPED);
	return 1;
}

/* unenrolled_local is the verdict for a TCP packet whose own end (local:
 * the destination on ingress, the source on egress) is not an enrolled
 * address. On an enrolled pod's interface that address is the pod's all the
 * same: its IPv6 link-local address, which is never enrolled, or one the
 * loader was not given (SLAAC, secondary). The programs never capture such a
 * connection, so it is dropped while the pod's capture in that direction
 * is on: the pod's TCP never passes the capture in plaintext. Elsewhere,
 * and for ingress frames the host would not take, it is not the mesh's. */
static __always_inline int unenrolled_local(struct __sk_buff *skb, const struct pod_addr *local, int ingress)
{
	__u32 flag = ingress ? POD_CAPTURE_INBOUND : POD_CAPTURE_OUTBOUND;
	struct pod_settings *pod;
	struct pod_addr owner;

	if (not_for_host(skb, ingress))
		return TC_ACT_UNSPEC;
	pod = netns_pod(skb, &owner);
	if (!pod || !(pod->flags & flag))
		return TC_ACT_UNSPEC;
	count(is_link_local(local) ? REASON_DROP_LINK_LOCAL : REASON_DROP_UNENROLLED_ADDR, &owner, CNT_DROPPED);
	return TC_ACT_SHOT;
}

/* The kernel's struct sock_common: only the field clear_timewait reads,
 * located at load time through BTF (CO-RE). */
struct sock_common {
	__u32 skc_tw_rcv_nxt;
} __attribute__((preserve_access_index));

/* tw_rcv_nxt reads the next sequence number a TIME_WAIT socket expects from
 * its peer. bpf_skc_to_tcp_timewait_sock would be the typed way, but it
 * returns NULL for TIME_WAIT sockets on the kernels tested (6.18), so the
 * field is read with bpf_probe_read_kernel (the agent has CAP_SYS_ADMIN).
 * The socket pointer is turned into a number first: the verifier allows no
 * arithmetic on socket pointers. */
static __always_inline int tw_rcv_nxt(struct bpf_sock *sk, __u32 *out)
{
	__u64 base;

	if (bpf_probe_read_kernel(&base, sizeof(base), &sk) < 0)
		return -1;
	base += __builtin_preserve_field_info(((struct sock_common *)0)->skc_tw_rcv_nxt, BPF_FIELD_BYTE_OFFSET);
	return bpf_probe_read_kernel(out, sizeof(*out), (void *)base) < 0 ? -1 : 0;
}

#define TCP_FLAGS_OFF 12 /* the 16-bit word of data offset and flags */
#define TCP_SEQ_OFF 4
#define TCP_CHECK_OFF 16

/* clear_timewait handles a SYN whose own tuple is in TIME_WAIT. Assigning it
 * to a listener is not enough: the listener's new request socket has the
 * same tuple, and the kernel refuses to hash it next to the TIME_WAIT entry
 * (since Linux 6.10 the SYN is then dropped silently), while the kernel's own
 * TIME_WAIT handling only hands a SYN on to a listener of the original port,
 * which the tunnel does not have. So, as the TIME_WAIT rules of RFC 1122 and
 * RFC 6191 allow a new SYN to reopen the tuple:
 *   - a clone of the SYN is queued to this interface's ingress (it comes back
 *     to this program after the current packet is done, and is assigned);
 *   - the packet itself becomes a RST with the sequence number the TIME_WAIT
 *     socket expects, which the kernel's demux delivers to it, ending it
 *     (net.ipv4.tcp_rfc1337=0, the default).
 * The RST carries no TCP options, so PAWS never discards it, whatever the
 * SYN's timestamp. The clone carries HASH_SYN_REQUEUED (requeued, for the
 * SYN that comes back with it): if its tuple is still in TIME_WAIT then,
 * because the RST did not end the socket (net.ipv4.tcp_rfc1337=1 in the
 * pod), it is dropped rather than looped. Unlike the kernel's
 * own TIME_WAIT handling, the SYN is not checked to be newer than the old
 * connection (sequence number or timestamp): an old duplicate SYN of the same
 * tuple also ends the TIME_WAIT, as tcp_tw_reuse would allow.
 * Returns 0, or the reason to drop the SYN. */
static __always_inline int clear_timewait(struct __sk_buff *skb, const struct tcp_pkt *p, struct bpf_sock *sk,
					  int requeued)
{
	__u32 hash = skb->hash, rcv_nxt;
	__be32 old_seq, new_seq;
	__be16 old_flags, new_flags;
	__u8 *fb = (__u8 *)&new_flags;

	if (requeued)
		return REASON_DROP_SYN_TIMEWAIT;
	if (tw_rcv_nxt(sk, &rcv_nxt) < 0)
		return REASON_DROP_SYN_TIMEWAIT;
	new_seq = bpf_htonl(rcv_nxt);

	if (bpf_skb_load_bytes(skb, p->l4_off + TCP_SEQ_OFF, &old_seq, sizeof(old_seq)) < 0 ||
	    bpf_skb_load_bytes(skb, p->l4_off + TCP_FLAGS_OFF, &old_flags, sizeof(old_flags)) < 0)
		return REASON_DROP_SYN_TIMEWAIT;
	new_flags = old_flags;
	/* Data offset 5: the SYN's options (its timestamp above all) and any
	 * data become the RST's payload, which the TIME_WAIT socket ignores.
	 * A RST with the SYN's timestamp was discarded by PAWS whenever that
	 * timestamp was older than the socket's last (clients behind one NAT
	 * address, as kube-proxy's SNAT of NodePort traffic makes them), and
	 * the SYN was dropped until the TIME_WAIT expired, 60 s, where the
	 * kernel's own handling costs such a client a 1 s retransmission.
	 * RFC 7323 (5.3) says a RST should carry no timestamp and be taken
	 * whatever its timestamp; Linux sends none. */
	fb[0] = 0x50; /* data offset 5, nothing reserved, no AE bit */
	fb[1] = 0x04; /* RST only: no SYN, no ACK, no ECN bits */

	bpf_set_hash(skb, HASH_SYN_REQUEUED);
	if (bpf_clone_redirect(skb, skb->ifindex, BPF_F_INGRESS) < 0)
		return REASON_DROP_SYN_TIMEWAIT;
	if (hash)
		bpf_set_hash(skb, hash);
	else
		bpf_set_hash_invalid(skb);

	/* The checksum field follows the data; the packet's skb->csum, if any,
	 * stays right because the two changes cancel out. */
	if (bpf_l4_csum_replace(skb, p->l4_off + TCP_CHECK_OFF, old_seq, new_seq, sizeof(new_seq)) < 0 ||
	    bpf_l4_csum_replace(skb, p->l4_off + TCP_CHECK_OFF, old_flags, new_flags, sizeof(new_flags)) < 0 ||
	    bpf_skb_store_bytes(skb, p->l4_off + TCP_SEQ_OFF, &new_seq, sizeof(new_seq), 0) < 0 ||
	    bpf_skb_store_bytes(skb, p->l4_off + TCP_FLAGS_OFF, &new_flags, sizeof(new_flags), 0) < 0)
		return REASON_DROP_SYN_TIMEWAIT;
	return 0;
}

/* steer re-injects an egress packet into the same interface's ingress and
 * counts it under reason and f. The destination MAC becomes the interface's
 * own (else the stack drops it as PACKET_OTHERHOST) and the mark tells
 * ingress and the fwmark rule that the packet came from here, not from the
 * wire. A packet it cannot rewrite (no memory) is dropped, and counted as
 * such rather than as steered; TCP sends it again. */
static __always_inline int steer(struct __sk_buff *skb, __u32 reason, const struct pod_addr *pod, enum counter_field f)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	__u8 own[ETH_ALEN];

	if ((void *)(eth + 1) > end)
		goto fail;
	__builtin_memcpy(own, eth->h_source, ETH_ALEN);
	if (bpf_skb_store_bytes(skb, offsetof(struct ethhdr, h_dest), own, ETH_ALEN, 0) < 0)
		goto fail;
	count(reason, pod, f);
	skb->mark = reinject_mark;
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
fail:
	count(REASON_DROP_STEER, pod, CNT_DROPPED);
	return TC_ACT_SHOT;
}

/* tunnel_socket reports whether a socket the lookup found is one of the
 * tunnel's own (it carries the tunnel mark). */
static __always_inline int tunnel_socket(struct bpf_sock *sk)
{
	struct bpf_sock *full = bpf_sk_fullsock(sk);

	return full && (full->mark & mark_mask) == tunnel_mark;
}

/* assign_listener hands the packet to the tunnel listener on port, looked up
 * with the packet's tuple and the destination port replaced. Returns 0 when
 * assigned, or the reason to drop (fail closed: never pass it in plaintext).
 * The listener found must carry the tunnel mark: a process in the pod that
 * binds the port to the pod's own address (with SO_REUSEPORT, which the
 * tunnel's listeners have, as the same user) is the more specific match, and
 * would be handed every captured connection of that address in plaintext,
 * past the agent's policy. */
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
	if (!tunnel_socket(sk)) {
		bpf_sk_release(sk);
		return REASON_DROP_FOREIGN_LISTENER;
	}
	err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	if (err)
		return REASON_DROP_ASSIGN_FAILED;
	skb->mark = reinject_mark;
	return 0;
}

/* app_syn_sent reports whether a socket the lookup found is an app's (no
 * tunnel mark) in SYN_SENT: a SYN from the wire for its tuple would be taken
 * by the kernel as a simultaneous open. */
static __always_inline int app_syn_sent(struct bpf_sock *sk)
{
	return sk->state == BPF_TCP_SYN_SENT && !tunnel_socket(sk);
}

/* simultaneous_open reports (and counts as drop_syn_sent) a SYN from the
 * wire whose tuple is an app socket in SYN_SENT of a pod whose outbound
 * capture is on, for the verdicts that pass a SYN without take_syn: the
 * pod's inbound capture off, and the HBONE port (an app bound to the pod
 * address and that port, next to the tunnel's reuseport listener). Its
 * outbound is meshed all the same: see take_syn. */
static __always_inline int simultaneous_open(struct __sk_buff *skb, struct tcp_pkt *p, const struct pod_settings *pod)
{
	struct bpf_sock *sk;
	int sent;

	if (!p->syn || p->ack || !(pod->flags & POD_CAPTURE_OUTBOUND))
		return 0;
	sk = lookup_tcp(skb, p);
	if (!sk)
		return 0;
	sent = app_syn_sent(sk);
	bpf_sk_release(sk);
	if (sent)
		count(REASON_DROP_SYN_SENT, &p->dst, CNT_DROPPED);
	return sent;
}

/* take_syn hands a new connection's SYN (no ACK) to the tunnel listener on
 * port, after checking the SYN's own tuple: free, or a listener of the
 * original port, it is assigned; in TIME_WAIT, clear_timewait reopens it; a
 * live socket (a request the SYN is a retransmission for, or a connection)
 * gets the SYN as TCP would without the mesh: pass is the verdict that lets
 * the kernel deliver it. pod is the address counted. Every SYN not assigned
 * is counted under its own reason.
 *
 * Except, for a SYN from the wire to a pod whose outbound capture is on
 * (wire set), a socket of the app in SYN_SENT: the app's own SYN for that
 * tuple was captured and never left the pod, so nobody on the wire can be
 * opening the same connection; the
 * kernel would take the SYN as a simultaneous open and connect the app to
 * its sender in plaintext. It is dropped (drop_syn_sent). The tunnel's own
 * sockets (tunnel mark) are left to TCP. */
static __always_inline int take_syn(struct __sk_buff *skb, struct tcp_pkt *p, __u16 port, const struct pod_addr *pod,
				    __u32 assigned, enum counter_field field, int pass, int wire)
{
	int requeued = skb->hash == HASH_SYN_REQUEUED;
	struct bpf_sock *sk;
	int reason;

	/* the marker has done its work: the SYN goes on without it */
	if (requeued)
		bpf_set_hash_invalid(skb);
	sk = lookup_tcp(skb, p);
	if (sk) {
		__u32 state = sk->state;

		if (wire && app_syn_sent(sk)) {
			bpf_sk_release(sk);
			count(REASON_DROP_SYN_SENT, pod, CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		if (state == BPF_TCP_TIME_WAIT) {
			reason = clear_timewait(skb, p, sk, requeued);
			bpf_sk_release(sk);
			if (reason) {
				count(reason, pod, CNT_DROPPED);
				return TC_ACT_SHOT;
			}
			count(REASON_IN_SYN_TIMEWAIT, pod, CNT_STEERED);
			return pass;
		}
		bpf_sk_release(sk);
		if (state != BPF_TCP_LISTEN) {
			count(REASON_IN_SYN_EXISTING, pod, CNT_BYPASSED);
			return pass;
		}
	}
	reason = assign_listener(skb, p, port);
	if (reason) {
		count(reason, pod, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	count(assigned, pod, field);
	return TC_ACT_OK;
}

/* cookie_ack handles an ACK (no SYN, no RST) from the wire to a pod whose
 * inbound is captured. A packet of a connection (or of a request, or of a
 * TIME_WAIT socket) goes on to it: TC_ACT_UNSPEC. With no socket for its
 * tuple, the kernel would hand it to a listener of the packet's own port:
 * the app's. When the pod sends SYN cookies (the inbound listener's SYN
 * queue overflowed, or net.ipv4.tcp_syncookies=2, which Kubernetes lets a
 * pod set), the tunnel's inbound listener answered the client's SYN with a
 * cookie and kept no request, and the app's listener takes that cookie as
 * its own once it has sent cookies itself (to the tunnel's dials): the
 * client would be connected to the app in plaintext, past the tunnel and
 * its policy. So an ACK that would reach a listener is assigned to the
 * inbound listener instead, which checks the cookie (or answers with a RST,
 * as any listener does to an ACK it has no request for); with none, it is
 * dropped as a SYN would be. An ACK no socket would take is left to the
 * kernel, which resets it. One to another pod's address (foreign_dst) is
 * dropped, as its SYN would have been: assigned, it would be delivered
 * (the reinject mark routes it locally) where the kernel drops it as not
 * local, and SYN cookies are checked with the host's secret, not the
 * namespace's. */
static __always_inline int cookie_ack(struct __sk_buff *skb, struct tcp_pkt *p, const struct pod_settings *pod)
{
	struct bpf_sock *sk = lookup_tcp(skb, p);
	__u32 state;
	int reason;

	if (!sk)
		return TC_ACT_UNSPEC; /* no socket takes it: the kernel resets */
	state = sk->state;
	bpf_sk_release(sk);
	if (state != BPF_TCP_LISTEN)
		return TC_ACT_UNSPEC;
	if (foreign_dst(skb, pod))
		return TC_ACT_SHOT;
	reason = assign_listener(skb, p, inbound_port);
	if (reason) {
		count(reason, &p->dst, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	count(REASON_IN_ASSIGN_COOKIE_ACK, &p->dst, CNT_STEERED);
	return TC_ACT_OK;
}

#define DNS_SERVER_PORT 53

/* dns_query reports whether a PARSE_UDP packet may be a DNS query: to port
 * 53, or with its ports unreadable (it cannot be told apart from one). */
static __always_inline int dns_query(const struct tcp_pkt *p)
{
	return !p->has_ports || bpf_ntohs(pkt_dport(p)) == DNS_SERVER_PORT;
}

/* dns_egress is rd_pod_egress for UDP: a query to port 53 of a pod whose
 * DNS is captured is re-injected into ingress, where rd_pod_ingress assigns
 * it to the tunnel's DNS socket (assign_dns), as istio-cni's
 * `-p udp --dport 53 -j REDIRECT --to-port 15053` does with conntrack. The
 * tunnel's own queries upstream (tunnel mark) pass. A query the programs
 * cannot steer cleanly (parse_tcp's unclean reasons), one to a loopback
 * address (a socket bound to the device), and one from an address of the
 * pod's interface that is not enrolled (link-local, SLAAC) or that is
 * another pod's (foreign_src) is dropped: with
 * DNS capture on, no query leaves the pod uncaptured. Everything else, and
 * everything of pods without DNS capture, passes as it always did. */
static __always_inline int dns_egress(struct __sk_buff *skb, const struct tcp_pkt *p)
{
	int tunnel = (skb->mark & mark_mask) == tunnel_mark;
	struct pod_settings *pod;
	struct pod_addr owner;

	if (!dns_query(p))
		return TC_ACT_UNSPEC;
	pod = bpf_map_lookup_elem(&rd_pods, &p->src);
	if (!pod) {
		if (tunnel)
			return TC_ACT_UNSPEC;
		pod = netns_pod(skb, &owner);
		if (!pod || !(pod->flags & POD_CAPTURE_DNS))
			return TC_ACT_UNSPEC;
		count(is_link_local(&p->src) ? REASON_DROP_LINK_LOCAL : REASON_DROP_UNENROLLED_ADDR, &owner, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	if (!tunnel && foreign_src(skb, pod, POD_CAPTURE_DNS))
		return TC_ACT_SHOT;
	if (!(pod->flags & POD_CAPTURE_DNS))
		return TC_ACT_UNSPEC;
	if (tunnel) {
		count(REASON_OUT_PASS_TUNNEL_MARK, &p->src, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (p->unclean) {
		count(p->unclean, &p->src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	if (is_loopback(&p->dst)) {
		count(REASON_DROP_LOOPBACK, &p->src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	return steer(skb, REASON_OUT_DNS_STEERED, &p->src, CNT_STEERED);
}

/* assign_dns hands a DNS query dns_egress re-injected to the tunnel's DNS
 * socket: the UDP socket on dns_port that the packet's tuple, with that
 * destination port, finds (bound to the wildcard address, dual-stack). It
 * keeps the reinject mark, so the fwmark rule routes it locally although
 * its destination is the resolver's address; the socket reads that address
 * and port 53 from IP(V6)_ORIGDSTADDR. The socket must carry the tunnel
 * mark: a process in the pod may bind dns_port itself (to the resolver's
 * address, the more specific match, with IP_FREEBIND). No socket or a
 * foreign one fails the query, as a REDIRECT to a port nobody listens on
 * does. Returns the verdict. */
static __always_inline int assign_dns(struct __sk_buff *skb, struct tcp_pkt *p)
{
	struct bpf_sock *sk;
	long err;

	set_dport(p, dns_port);
	sk = lookup_udp(skb, p);
	if (!sk) {
		count(REASON_DROP_NO_DNS_SOCKET, &p->src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	if (!tunnel_socket(sk)) {
		bpf_sk_release(sk);
		count(REASON_DROP_FOREIGN_DNS_SOCKET, &p->src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	if (err) {
		count(REASON_DROP_ASSIGN_FAILED, &p->src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	count(REASON_IN_ASSIGN_DNS, &p->src, CNT_STEERED);
	return TC_ACT_OK;
}

/* dns_ingress is rd_pod_ingress for a re-injected UDP packet: a query of a
 * pod whose DNS is captured goes to assign_dns (one that is not clean cannot
 * have been steered, so it is dropped, not passed); 1 with the verdict in
 * *verdict, 0 for what is not such a query. */
static __always_inline int dns_ingress(struct __sk_buff *skb, struct tcp_pkt *p, int *verdict)
{
	struct pod_settings *pod;

	if ((skb->mark & mark_mask) != reinject_mark || !dns_query(p))
		return 0;
	pod = bpf_map_lookup_elem(&rd_pods, &p->src);
	if (!pod || !(pod->flags & POD_CAPTURE_DNS))
		return 0;
	if (p->unclean) {
		count(p->unclean, &p->src, CNT_DROPPED);
		*verdict = TC_ACT_SHOT;
		return 1;
	}
	*verdict = assign_dns(skb, p);
	return 1;
}

/* rd_pod_egress: tcx egress of the pod interface (pod -> world).
 *
 * Verdicts:
 *   TC_ACT_UNSPEC  (tcx next) for everything not ours: non-TCP (but a
 *                  DNS query of a pod with DNS capture: dns_egress), an
 *                  unenrolled source on an interface that is no enrolled
 *                  pod's, tunnel-marked sockets, the probe SNAT address, and
 *                  packets of connections the tunnel does not own;
 *   bpf_redirect   to this interface's ingress for a new outbound connection
 *                  (SYN without ACK) of an enrolled pod, and for any packet
 *                  whose tuple belongs to a tunnel socket (the app's side of a
 *                  captured or source-preserved connection), and for a
 *                  UDP query to port 53 of a pod with DNS capture
 *                  (dns_egress);
 *   TC_ACT_SHOT    such a query that cannot be steered cleanly (a
 *                  fragment, IPv4 options, IPv6 extension headers, a
 *                  stacked VLAN tag, a cut UDP header), to a loopback
 *                  address, or from an address of the pod's interface that
 *                  is not enrolled (dns_egress);
 *   TC_ACT_SHOT    a packet of an app socket whose connection was captured
 *                  (rd_captured: its SYN was steered, or a tunnel socket
 *                  owned its packets; rd_dialled: the tunnel dialled it)
 *                  that no tunnel socket owns any more, and a SYN or a
 *                  tunnel-owned packet whose app socket cannot be marked so;
 *   TC_ACT_SHOT    a SYN-ACK from a pod whose inbound is captured that no
 *                  tunnel socket sent or owns: another member of the
 *                  tunnel's reuseport group answering (drop_foreign_listener);
 *   TC_ACT_SHOT    a SYN or SYN-ACK, or a query dns_egress would judge,
 *                  from an enrolled address of another pod than the one
 *                  whose interface this is (foreign_src: IPV6_FREEBIND);
 *   TC_ACT_SHOT    an IP packet from or to an enrolled address, or on an
 *                  enrolled pod's interface, that parse_tcp cannot classify
 *                  (truncated or malformed headers, TCP in fragments, hidden
 *                  payloads, stacked VLAN tags: drop_unparsed), TCP from an
 *                  address of an enrolled pod's interface that is not
 *                  enrolled (its link-local address above all:
 *                  unenrolled_local), TCP to a loopback address
 *                  (drop_loopback), and a packet whose Ethernet header
 *                  cannot be rewritten.
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
	int ret = parse_tcp(skb, &p);

	if (ret == PARSE_UDP)
		return dns_egress(skb, &p);
	if (ret == PARSE_OTHER)
		return TC_ACT_UNSPEC;
	if (ret != PARSE_TCP)
		return drop_unparsed(skb, &p, ret, 0);
	pod = bpf_map_lookup_elem(&rd_pods, &p.src);
	if (!pod) {
		if ((skb->mark & mark_mask) == tunnel_mark)
			return TC_ACT_UNSPEC;
		return unenrolled_local(skb, &p.src, 0);
	}

	if ((skb->mark & mark_mask) == tunnel_mark) {
		count(REASON_OUT_PASS_TUNNEL_MARK, &p.src, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	/* Loopback traffic never reaches the pod's interface, except from a
	 * socket bound to it (SO_BINDTODEVICE, no capability needed): it
	 * would leave uncaptured towards a node that may take it
	 * (route_localnet). */
	if (is_loopback(&p.dst)) {
		count(REASON_DROP_LOOPBACK, &p.src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	/* A SYN or SYN-ACK is judged by its source pod's settings below: that
	 * pod must be the one whose interface this is. */
	if (p.syn && foreign_src(skb, pod, POD_CAPTURE_OUTBOUND))
		return TC_ACT_SHOT;
	if (is_probe_addr(&p.dst)) {
		count(REASON_OUT_PASS_EXCLUDED, &p.src, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (p.syn && !p.ack) {
		if (!(pod->flags & POD_CAPTURE_OUTBOUND))
			return TC_ACT_UNSPEC;
		if (!mark_captured(skb)) {
			count(REASON_DROP_CAPTURE_MARK, &p.src, CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		return steer(skb, REASON_OUT_SYN_STEERED, &p.src, CNT_OUTBOUND_CONN);
	}
	if (tunnel_owns(skb, &p)) {
		if (!keep_captured(skb, &p)) {
			count(REASON_DROP_CAPTURE_MARK, &p.src, CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		return steer(skb, REASON_OUT_TUNNEL_SOCKET, &p.src, CNT_STEERED);
	}
	if (was_captured(skb, &p)) {
		count(REASON_DROP_TUNNEL_GONE, &p.src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	/* A SYN-ACK no tunnel socket sent or owns, from a pod whose inbound is
	 * captured: every SYN from the wire to such a pod goes to the tunnel's
	 * inbound listener (the HBONE port's and the probes' are the tunnel's
	 * or passed above), so this one answers a SYN the kernel handed to
	 * another member of that listener's reuseport group. Since Linux 6.5
	 * it selects again within the group after bpf_sk_assign, by hash and
	 * with no mark to check, and a process in the pod running as the
	 * tunnel's user can join the group. Its SYN-ACK never leaves: it
	 * cannot open a plaintext connection past the agent's policy. */
	if (p.syn && p.ack && (pod->flags & POD_CAPTURE_INBOUND)) {
		count(REASON_DROP_FOREIGN_LISTENER, &p.src, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	return TC_ACT_UNSPEC;
}

/* rd_pod_ingress: tcx ingress of the pod interface (world -> pod, plus the
 * packets rd_pod_egress re-injected).
 *
 * For every packet: TC_ACT_SHOT for an IP packet from or to an enrolled
 * address, or for this host on an enrolled pod's interface, that parse_tcp
 * cannot classify (drop_unparsed), and for IPv4 from the wire from an
 * enrolled address of this same pod: not TCP, or TCP to an address that
 * is not enrolled (own_source: accept_local is on).
 * Verdicts for re-injected packets (they carry reinject_mark, which a packet
 * from another namespace cannot: the mark is scrubbed when crossing one):
 *   TC_ACT_OK      after bpf_sk_assign of a DNS query (UDP to port 53) of a
 *                  pod with DNS capture to the tunnel's DNS socket;
 *   TC_ACT_SHOT    for such a query when that socket is missing or is not
 *                  the tunnel's (dns_ingress);
 *   TC_ACT_OK      after bpf_sk_assign of an outbound SYN to the outbound
 *                  listener; other re-injected packets pass with the mark so
 *                  the fwmark rule delivers them locally to their socket, and
 *                  so do the SYNs take_syn leaves to TCP or turns into the RST
 *                  that ends a TIME_WAIT socket;
 *   TC_ACT_SHOT    when the listener is missing (tunnel down) or is not the
 *                  tunnel's (no tunnel mark), or the SYN's tuple stays in
 *                  TIME_WAIT: fail closed.
 * Verdicts for packets from the wire to an enrolled pod address:
 *   TC_ACT_SHOT    a source address of this same pod (spoofed: accept_local
 *                  is on for re-injection, so the stack would accept it);
 *   TC_ACT_UNSPEC  to the HBONE port, from the probe SNAT address, inbound
 *                  capture off, a packet of an existing connection, or a SYN
 *                  take_syn leaves to TCP or turns into a RST;
 *   TC_ACT_OK      after bpf_sk_assign of a new connection (SYN) to the
 *                  inbound plaintext listener;
 *   TC_ACT_SHOT    a TCP packet from the probe SNAT address that the host
 *                  veth program did not translate (no HASH_PROBE_SNAT);
 *   TC_ACT_SHOT    a SYN whose tuple is an app socket in SYN_SENT, while
 *                  the pod's outbound capture is on (its inbound capture on
 *                  or off): its own SYN was captured, so only a
 *                  simultaneous open by a sender on the wire could connect
 *                  it, in plaintext;
 *   TC_ACT_SHOT    a SYN, or an ACK cookie_ack would assign, to another
 *                  pod's address than the one whose interface this is
 *                  (foreign_dst);
 *   TC_ACT_SHOT    when that listener is missing or is not the tunnel's:
 *                  fail closed. A SYN whose
 *                  tuple is in TIME_WAIT is never passed as is: the kernel
 *                  would hand it to the app's own listener, in plaintext.
 * Verdicts for TCP from the wire to an address that is not enrolled:
 *   TC_ACT_SHOT    IPv4 from an enrolled address of the pod whose interface
 *                  this is, whatever its capture flags (own_source);
 *   TC_ACT_SHOT    on an enrolled pod's interface, when the frame is for this
 *                  host and the pod's inbound capture is on: the pod's
 *                  link-local address (drop_link_local) or another address
 *                  the loader was not given (drop_unenrolled_addr), which
 *                  the programs never capture (unenrolled_local);
 *   TC_ACT_UNSPEC  otherwise. */
SEC("tcx/ingress")
int rd_pod_ingress(struct __sk_buff *skb)
{
	struct pod_settings *pod, *src_pod;
	struct tcp_pkt p = {};
	int ret = parse_tcp(skb, &p), verdict;

	if (ret == PARSE_UDP) {
		if (dns_ingress(skb, &p, &verdict))
			return verdict;
		ret = PARSE_OTHER;
	}
	if (ret == PARSE_OTHER)
		return own_source(skb, &p) ? TC_ACT_SHOT : TC_ACT_UNSPEC;
	if (ret != PARSE_TCP)
		return drop_unparsed(skb, &p, ret, 1);

	if ((skb->mark & mark_mask) == reinject_mark) {
		pod = bpf_map_lookup_elem(&rd_pods, &p.src);
		if (!pod)
			return TC_ACT_UNSPEC;
		if (!(p.syn && !p.ack)) {
			count(REASON_IN_PASS_REINJECTED, &p.src, CNT_STEERED);
			return TC_ACT_OK;
		}
		return take_syn(skb, &p, outbound_port, &p.src, REASON_IN_ASSIGN_OUTBOUND, CNT_STEERED, TC_ACT_OK, 0);
	}

	pod = bpf_map_lookup_elem(&rd_pods, &p.dst);
	if (!pod) {
		/* the pod's own source is a spoof whatever the destination
		 * (a secondary address, with inbound capture off too) */
		if (own_source(skb, &p))
			return TC_ACT_SHOT;
		return unenrolled_local(skb, &p.dst, 1);
	}
	src_pod = bpf_map_lookup_elem(&rd_pods, &p.src);
	if (src_pod && src_pod->pod_id == pod->pod_id) {
		count(REASON_DROP_SPOOFED, &p.dst, CNT_DROPPED);
		return TC_ACT_SHOT;
	}
	if (bpf_ntohs(pkt_dport(&p)) == hbone_port) {
		if (simultaneous_open(skb, &p, pod))
			return TC_ACT_SHOT;
		count(REASON_IN_PASS_HBONE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (is_probe_addr(&p.src)) {
		/* only the host-veth program's translation makes a probe */
		if (skb->hash != HASH_PROBE_SNAT) {
			count(REASON_DROP_PROBE_SPOOFED, &p.dst, CNT_DROPPED);
			return TC_ACT_SHOT;
		}
		count(REASON_IN_PASS_PROBE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (!(pod->flags & POD_CAPTURE_INBOUND)) {
		if (simultaneous_open(skb, &p, pod))
			return TC_ACT_SHOT;
		count(REASON_IN_PASS_NO_CAPTURE, &p.dst, CNT_BYPASSED);
		return TC_ACT_UNSPEC;
	}
	if (!(p.syn && !p.ack)) {
		if (p.ack && !p.syn && !p.rst)
			return cookie_ack(skb, &p, pod);
		/* the kernel's own demux finds the connection's socket */
		return TC_ACT_UNSPEC;
	}
	if (foreign_dst(skb, pod))
		return TC_ACT_SHOT;
	return take_syn(skb, &p, inbound_port, &p.dst, REASON_IN_ASSIGN_INBOUND, CNT_INBOUND_CONN, TC_ACT_UNSPEC,
			pod->flags & POD_CAPTURE_OUTBOUND);
}

#define RD_SOL_SOCKET 1
#define RD_SO_MARK 36

/* route_locally gives an app socket the reinject mark, keeping its other
 * mark bits: the pod's fwmark rule then routes every later packet of it
 * through the local table, over lo, straight to the tunnel socket that
 * terminates its connection, instead of out of the pod's interface, through
 * rd_pod_egress and back in. The route is local for every destination, so a
 * marked socket cannot reach the wire whatever happens to the tunnel's end:
 * with no tunnel socket left, its segments meet the pod's own TCP, which
 * has no socket for them. */
static __always_inline void route_locally(struct bpf_sock_ops *skops, struct bpf_sock *sk, const struct pod_addr *pod)
{
	int mark = (sk->mark & ~mark_mask) | (reinject_mark & mark_mask);

	if (bpf_setsockopt(skops, RD_SOL_SOCKET, RD_SO_MARK, &mark, sizeof(mark)) == 0)
		count(REASON_SOCK_ROUTED_LOCAL, pod, CNT_REASON_ONLY);
}

/* rd_pod_sockops: cgroup sock_ops, on the sockets of the node's pods. It
 * takes the capture off the packet path of a connection once it is
 * established: an app socket whose connection the tunnel terminates in the
 * same pod is routed over lo (route_locally), the way an app reaches a relay
 * it dials explicitly. Which sockets qualify is decided by the capture
 * programs, never by the app:
 *   - an app's outbound connection whose SYN rd_pod_egress steered (it
 *     carries rd_captured): its SYN never left the pod, so the peer that
 *     completed its handshake is the tunnel's outbound listener;
 *   - an app's accepted connection that the tunnel dialled from the
 *     client's address (rd_pod_egress left its tuple in rd_dialled when the
 *     app's SYN-ACK went to a tunnel socket); it gets rd_captured here.
 * Every other socket is left alone, and a socket this misses (one from
 * before this program, a sock_ops program detached) still takes the packet
 * path, which captures it as before. Other agents' sockets sharing the
 * cgroup (simulated nodes) find no entry in this agent's maps. */
SEC("sockops")
int rd_pod_sockops(struct bpf_sock_ops *skops)
{
	struct dialled_key k = {};
	struct bpf_sock *sk;
	__u32 ip6[4];

	if (skops->op != BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB && skops->op != BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB)
		return 1;
	if (skops->family != 2 && skops->family != 10)
		return 1;
	sk = skops->sk;
	if (!sk || (sk->mark & mark_mask) == tunnel_mark)
		return 1;
	ip6[0] = *(volatile __u32 *)&skops->local_ip6[0];
	ip6[1] = *(volatile __u32 *)&skops->local_ip6[1];
	ip6[2] = *(volatile __u32 *)&skops->local_ip6[2];
	ip6[3] = *(volatile __u32 *)&skops->local_ip6[3];
	set_addr(k.src.addr, skops->family, skops->local_ip4, ip6);

	if (skops->op == BPF_SOCK_OPS_ACTIVE_ESTABLISHED_CB) {
		if (bpf_sk_storage_get(&rd_captured, sk, 0, 0))
			route_locally(skops, sk, &k.src);
		return 1;
	}

	ip6[0] = *(volatile __u32 *)&skops->remote_ip6[0];
	ip6[1] = *(volatile __u32 *)&skops->remote_ip6[1];
	ip6[2] = *(volatile __u32 *)&skops->remote_ip6[2];
	ip6[3] = *(volatile __u32 *)&skops->remote_ip6[3];
	set_addr(k.dst.addr, skops->family, skops->remote_ip4, ip6);
	k.sport = bpf_htons((__u16)skops->local_port);
	k.dport = net_port(skops->remote_port);
	if (!bpf_map_lookup_elem(&rd_dialled, &k))
		return 1;
	/* the socket carries the capture mark from now on, as keep_captured
	 * would give it on its first packet */
	if (!bpf_sk_storage_get(&rd_captured, sk, 0, BPF_SK_STORAGE_GET_F_CREATE))
		return 1;
	bpf_map_delete_elem(&rd_dialled, &k);
	route_locally(skops, sk, &k.src);
	return 1;
}
