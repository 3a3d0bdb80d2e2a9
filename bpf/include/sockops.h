/* Types of the optional sockops acceleration (sockops.c). */
#pragma once

#include <linux/types.h>

/* One end of a local TCP connection: addresses IPv4-mapped, ports in
 * network order, and the network namespace, so that only two sockets of the
 * same namespace ever pair up. */
struct sock_key {
	__u8 local[16];
	__u8 remote[16];
	__u16 lport;
	__u16 rport;
	__u32 _pad;
	__u64 netns;
};

/* Counters of the acceleration, per CPU. */
struct accel_counters {
	__u64 sockets;        /* sockets added to the pair map */
	__u64 redirected;     /* messages moved to the peer socket directly */
	__u64 redirected_bytes;
	__u64 passed;         /* messages sent the normal way (no local peer yet) */
};
