//go:build ignore

/* Optional acceleration between a pod's app and the tunnel (Merbridge's
 * idea): both ends of a captured connection are sockets in the same pod
 * namespace, so their payload can move socket to socket without a trip
 * through the TCP stack, the pod interface and the re-injection. Off unless
 * SOCKOPS_ACCELERATION is set. */

#include <linux/bpf.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>
#include <bpf/bpf_helpers.h>
#include "include/maps.h"
#include "include/sockops.h"
#include "include/skaddr.h"

char __license[] SEC("license") = "GPL";

/* SO_MARK of the tunnel's own sockets, under mark_mask, and the HBONE port
 * (set by the agent). */
volatile const __u32 mark_mask = 0xfff;
volatile const __u32 tunnel_mark = 0x539;
volatile const __u16 hbone_port = 15008;

/* Connected sockets of this node's apps, by their own key: rd_sk_msg runs
 * on their sends. The kernel drops a socket from a sockhash when it closes. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_app_socks SEC(".maps");

/* The tunnel's sockets in this node's pods, the redirect targets. No
 * program hangs off this map, so their own sends take the plain TCP code. */
struct {
	__uint(type, BPF_MAP_TYPE_SOCKHASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u32);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_tunnel_socks SEC(".maps");

/* The sockets of both sockhashes that are still open, with their state.
 * sk_msg cannot look a socket up in a sockhash, and redirecting to a
 * missing key drops the data, so it checks here first. Entries leave when
 * the socket closes. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, struct sock_state);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_sock_state SEC(".maps");

/* Bytes the tunnel has read from one of its pod-side sockets, by that
 * socket's key: what gives the app's sends their budget back. Written by
 * the agent as it reads (every 64 KiB). Entries leave when the socket
 * closes (here and in the agent). */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct sock_key);
	__type(value, __u64);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_sock_consumed SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct accel_counters);
	__uint(pinning, LIBBPF_PIN_BY_NAME);
} rd_accel_stats SEC(".maps");

const struct accel_counters *unused_accel_counters __attribute__((unused));
const struct sock_state *unused_sock_state __attribute__((unused));

/* The kernel's tcp_sock, only the fields read here; CO-RE finds their
 * offsets in the running kernel's BTF. */
struct tcp_sock {
	__u32 snd_nxt;
	__u32 write_seq;
	__u64 bytes_sent;
} __attribute__((preserve_access_index));


/* The kernel's sock (a tcp_sock begins with it, and it with its
 * sock_common) and its flag bits: only what send_reports reads, located at
 * load time through BTF (CO-RE). Newer kernels keep the flags in sock_common,
 * and sk_tsflags grew from 16 to 32 bits. */
struct sock_common___zc {
	unsigned long skc_flags;
} __attribute__((preserve_access_index));

struct sock___zc {
	unsigned long sk_flags;
	__u32 sk_tsflags;
} __attribute__((preserve_access_index));

enum sock_flags___zc { SOCK_ZEROCOPY___zc = 0 };

/* SO_TIMESTAMPING flags that ask for a report of each send: hardware,
 * software, scheduler, acknowledgment and completion time stamps. */
#define TX_TIMESTAMPS ((1 << 0) | (1 << 1) | (1 << 8) | (1 << 9) | (1 << 18))

/* send_reports says whether the socket tp asked the kernel to report on
 * its sends on the error queue: MSG_ZEROCOPY completions (SO_ZEROCOPY; an
 * accepted socket inherits it from its listener) or transmit time stamps
 * (SO_TIMESTAMPING). The sockmap's send path copies every message and, for
 * a redirected one, reports nothing: an app that waits for the reports of
 * its sends would wait for ones that never come (keeping its zerocopy
 * buffers pinned). */
static __always_inline int send_reports(struct tcp_sock *tp)
{
	unsigned long flags = 0;
	__u32 ts = 0;

	if (bpf_core_field_exists(struct sock___zc, sk_tsflags) &&
	    bpf_core_read(&ts, bpf_core_field_size(struct sock___zc, sk_tsflags),
			  &((struct sock___zc *)tp)->sk_tsflags) == 0 &&
	    (ts & TX_TIMESTAMPS))
		return 1;
	if (!bpf_core_enum_value_exists(enum sock_flags___zc, SOCK_ZEROCOPY___zc))
		return 0;
	if (bpf_core_field_exists(struct sock_common___zc, skc_flags))
		flags = ((struct sock_common___zc *)tp)->skc_flags;
	else if (bpf_core_field_exists(struct sock___zc, sk_flags))
		flags = ((struct sock___zc *)tp)->sk_flags;
	return (flags >> bpf_core_enum_value(enum sock_flags___zc, SOCK_ZEROCOPY___zc)) & 1;
}

/* The kernel's inet_connection_sock (a tcp_sock begins with it): only its
 * upper layer protocol, located at load time through BTF (CO-RE). */
struct inet_connection_sock___zc {
	void *icsk_ulp_ops;
} __attribute__((preserve_access_index));

/* has_ulp says whether an upper layer protocol runs on the socket: kTLS,
 * which the app's TLS library sets once its handshake is done, so after
 * pairing. kTLS runs this program on the plaintext of each record before it
 * encrypts it, and a redirect sends that plaintext to the tunnel, which
 * passes it on as the app's bytes: in the clear on the wire to a destination
 * outside the mesh, and never as TLS to the app's peer. */
static __always_inline int has_ulp(struct tcp_sock *tp)
{
	void *ops = NULL;

	if (!bpf_core_field_exists(struct inet_connection_sock___zc, icsk_ulp_ops))
		return 0;
	if (bpf_core_read(&ops, sizeof(ops), &((struct inet_connection_sock___zc *)tp)->icsk_ulp_ops) < 0)
		return 1; /* unknown: take the path that is right either way */
	return ops != NULL;
}

/* Context fields are read one 32-bit word at a time (volatile): the
 * verifier refuses the 64-bit loads the compiler would merge them into. */

static __always_inline struct accel_counters *stats(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&rd_accel_stats, &zero);
}

/* count adds n to a counter of c (atomically: a program can be preempted). */
#define count(c, field, n)                                                                         \
	do {                                                                                       \
		if (c)                                                                             \
			__sync_fetch_and_add(&(c)->field, (n));                                    \
	} while (0)

static __always_inline int enrolled(const __u8 *addr)
{
	struct pod_addr a;
	__builtin_memcpy(a.addr, addr, 16);
	return bpf_map_lookup_elem(&rd_pods, &a) != NULL;
}

static __always_inline int tunnel_socket(const struct bpf_sock *sk)
{
	return (sk->mark & mark_mask) == tunnel_mark;
}

/* ours says whether a socket belongs to a pod of this node: an app's socket
 * has the pod's address as its own, a tunnel socket has it as its peer's.
 * Deciding by one address per socket keeps both ends of a pair with the
 * same agent even when two agents share a cgroup (simulated nodes). */
static __always_inline int ours(const struct bpf_sock *sk, const struct sock_key *key)
{
	return tunnel_socket(sk) ? enrolled(key->remote) : enrolled(key->local);
}

/* rd_sockops: cgroup sock_ops, on every TCP socket of the cgroup.
 * Verdict: none (sock_ops only observes). When a connection of one of this
 * node's pods is established, its socket joins rd_app_socks (which makes
 * rd_sk_msg run on its sends) or, a tunnel socket, rd_tunnel_socks, and
 * rd_sock_state; when it closes, it leaves rd_sock_state and
 * rd_sock_consumed (the kernel drops it from the sockhash itself, already at
 * close(2)). connect() and accept() return after the callback, so normally
 * a socket joins before its owner sends; what was sent before (TCP Fast
 * Open, a send blocked in connect) is caught at the first send seen
 * (sent_before_pairing). HBONE connections (TLS, to another namespace)
 * never pair and stay out. */
SEC("sockops")
int rd_sockops(struct bpf_sock_ops *skops)
{
	struct sock_key key = {};
	struct sock_state fresh = {};
	struct bpf_sock *sk;
	struct tcp_sock *tp;
	void *socks;
	__u32 ip6l[4], ip6r[4];
	__u32 op = skops->op;

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
		if (skops->args[1] == BPF_TCP_CLOSE) {
			bpf_map_delete_elem(&rd_sock_state, &key);
			bpf_map_delete_elem(&rd_sock_consumed, &key);
		}
		return 1;
	}
	sk = skops->sk;
	if (!sk || !ours(sk, &key))
		return 1;
	if (skops->local_port == hbone_port || bpf_ntohs(key.rport) == hbone_port)
		return 1;
	/* The tunnel's sends to an app always take the TCP path: an app may
	 * read with splice(2) (Go's io.Copy between sockets does), which never
	 * sees a redirect queue. The tunnel itself reads only with read(2). */
	fresh.tunnel = tunnel_socket(sk);
	/* An app socket that wants its sends reported stays on TCP, whose
	 * send path reports them (send_reports). */
	tp = fresh.tunnel ? NULL : bpf_skc_to_tcp_sock(sk);
	if (tp && send_reports(tp)) {
		count(stats(), unpaired, 1);
		return 1;
	}
	socks = fresh.tunnel ? (void *)&rd_tunnel_socks : (void *)&rd_app_socks;
	/* Into the sockhash first, so a tunnel key in rd_sock_state is a
	 * redirect target until the tunnel closes the socket. Without a state
	 * entry the socket is not paired. The maps are the node's: one pod's
	 * many connections can fill them, and then new sockets stay on TCP,
	 * counted as unpaired.
	 * Never in place of a socket still open under the same key: a socket
	 * leaves the sockhash only at close(2), so a connection that reuses the
	 * 4-tuple of one in TIME_WAIT can find the old tunnel socket there with
	 * the app's last sends still in its queue, which replacing it would
	 * throw away. The new connection stays on TCP instead. */
	if (bpf_sock_hash_update(skops, socks, &key, BPF_NOEXIST) != 0) {
		count(stats(), unpaired, 1);
		return 1;
	}
	if (bpf_map_update_elem(&rd_sock_state, &key, &fresh, BPF_ANY) != 0) {
		bpf_map_delete_elem(socks, &key);
		count(stats(), unpaired, 1);
		return 1;
	}
	/* A report left by an earlier connection with the same key (an agent
	 * that died before closing) must not hand this one budget. (The
	 * tunnel's Conn reports nothing once it closed its socket, and the
	 * socket left the sockhash only then.) */
	if (fresh.tunnel)
		bpf_map_delete_elem(&rd_sock_consumed, &key);
	bpf_sock_ops_cb_flags_set(skops, skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
	struct accel_counters *c = stats();
	count(c, sockets, 1);
	return 1;
}

/* sent_before_pairing says whether the socket sent or queued data before its
 * first send seen here (TCP Fast Open writes from connect). Such bytes may
 * still wait in the peer's TCP queue, which the peer reads only after its
 * redirect queue. */
static __always_inline int sent_before_pairing(struct sk_msg_md *msg)
{
	struct bpf_sock *sk = msg->sk;
	struct tcp_sock *tp;

	if (!sk)
		return 1;
	tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 1;
	return tp->bytes_sent != 0 || tp->write_seq != tp->snd_nxt;
}

/* fall_back puts a sender on the TCP path for good: once one send took it,
 * a redirected one could be read before it. */
static __always_inline int fall_back(struct sock_state *me, struct accel_counters *c, __u64 *reason)
{
	me->tcp_only = 1;
	if (reason)
		__sync_fetch_and_add(reason, 1);
	count(c, passed, 1);
	return SK_PASS;
}

/* rd_sk_msg: sk_msg verdict on every send of an app socket (rd_app_socks).
 * Verdicts: the message is redirected into the ingress queue of the
 * connection's other end when that end is a paired tunnel socket of the
 * same namespace (the tunnel of a captured connection), every earlier send
 * of this socket was redirected too, the socket asked for no report of its
 * sends (send_reports) and runs no kTLS (has_ulp), and the peer's queue
 * stays within REDIRECT_BUDGET;
 * SK_PASS (the normal TCP path) otherwise, for good. Order
 * holds because the receiver reads its redirect queue before its TCP queue:
 * everything redirected must be sent before anything that is not. */
SEC("sk_msg")
int rd_sk_msg(struct sk_msg_md *msg)
{
	struct sock_key self = {}, peer = {};
	struct accel_counters *c = stats();
	struct sock_state *me, *other;
	struct tcp_sock *tp;
	__u32 ip6l[4], ip6r[4];
	__u64 *consumed, inflight;

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
	set_addr(self.local, msg->family, msg->local_ip4, ip6l);
	set_addr(self.remote, msg->family, msg->remote_ip4, ip6r);
	self.lport = bpf_htons((__u16)msg->local_port);
	self.rport = net_port(msg->remote_port);
	self.netns = bpf_get_netns_cookie(msg);
	/* The peer's key: our remote end is its local end. */
	__builtin_memcpy(peer.local, self.remote, 16);
	__builtin_memcpy(peer.remote, self.local, 16);
	peer.lport = self.rport;
	peer.rport = self.lport;
	peer.netns = self.netns;

	me = bpf_map_lookup_elem(&rd_sock_state, &self);
	if (!me || me->tcp_only) {
		count(c, passed, 1);
		return SK_PASS;
	}
	if (!me->checked) {
		me->checked = 1;
		if (sent_before_pairing(msg))
			return fall_back(me, c, c ? &c->fallback_early : NULL);
	}
	/* Asked for reports of its sends after it was paired (time stamps
	 * need an established socket): TCP reports them, counted as
	 * unpaired, since the tunnel then takes the socket out of the map. */
	/* kTLS set once paired (has_ulp): its records take TCP, encrypted.
	 * One look at the kernel's socket serves both checks. */
	tp = msg->sk ? bpf_skc_to_tcp_sock(msg->sk) : NULL;
	if (tp && (send_reports(tp) || has_ulp(tp)))
		return fall_back(me, c, c ? &c->unpaired : NULL);
	/* Redirecting to a missing peer would drop the data: look first. The
	 * peer may also be another app (a pod talking to itself, not captured). */
	other = bpf_map_lookup_elem(&rd_sock_state, &peer);
	if (!other || !other->tunnel)
		return fall_back(me, c, c ? &c->fallback_no_peer : NULL);
	consumed = bpf_map_lookup_elem(&rd_sock_consumed, &peer);
	inflight = me->sent;
	if (consumed) {
		__u64 read = *(volatile __u64 *)consumed;
		inflight = read < me->sent ? me->sent - read : 0;
	}
	if (inflight + msg->size > REDIRECT_BUDGET)
		return fall_back(me, c, c ? &c->fallback_budget : NULL);
	/* The tunnel's socket leaves the sockhash at close(2), its state only
	 * at TCP_CLOSE: a failed redirect means the tunnel is gone, and TCP
	 * gives the app the error it would have had without us. */
	if (bpf_msg_redirect_hash(msg, &rd_tunnel_socks, &peer, BPF_F_INGRESS) != SK_PASS)
		return fall_back(me, c, c ? &c->fallback_no_peer : NULL);
	me->sent += msg->size;
	count(c, redirected, 1);
	count(c, redirected_bytes, msg->size);
	return SK_PASS;
}

