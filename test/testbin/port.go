package testbin

import (
	"errors"
	"math/rand/v2"
	"net"
	"strconv"
)

// FreePort returns a TCP port free on 127.0.0.1 now, for a server the test
// starts next. It is picked below the kernel's ephemeral range (32768 and
// up by default): a port from that range may be taken by an outgoing
// connection before the server binds it (seen: istiod exiting on "bind:
// address already in use" mid-suite). Servers tests start on port 0 take
// ephemeral ports too, so this range is left to the ones started this way.
func FreePort() (int, error) {
	for range 1000 {
		p := 20000 + rand.IntN(12000)
		l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(p))
		if err != nil {
			continue
		}
		l.Close()
		return p, nil
	}
	return 0, errors.New("no free port in 20000-31999 on 127.0.0.1")
}
