package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// helpers are the small programs the suite runs inside pod namespaces as
// `meshbench <name> ...`: separate processes, so that a client or server
// never shares a Go runtime (scheduler, GC) with the suite or another side,
// and every socket is created natively in the pod's namespace.
var helpers = map[string]func(args []string) error{
	"echo":  echoMain,
	"rr":    rrMain,
	"cps":   cpsMain,
	"idle":  idleMain,
	"probe": probeMain,
	"relay": relayMain,
	"spin":  spinMain,
	"tap":   tapMain,
}

// spinMain keeps one CPU busy at SCHED_IDLE, the lowest priority: it runs
// only when nothing else wants the CPU, so the CPU never enters its idle
// state (on a VM: never halts), and a thread woken there runs at once.
// --awake uses it to show how much of a latency is the wake-up of idle
// vCPUs rather than work.
func spinMain(args []string) error {
	fs := flag.NewFlagSet("spin", flag.ContinueOnError)
	cpu := fs.Int("cpu", 0, "CPU to keep awake")
	if err := fs.Parse(args); err != nil {
		return err
	}
	runtime.LockOSThread()
	var set unix.CPUSet
	set.Set(*cpu)
	if err := unix.SchedSetaffinity(0, &set); err != nil {
		return fmt.Errorf("pin to CPU %d: %w", *cpu, err)
	}
	if err := unix.SchedSetAttr(0, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: schedIdle}, 0); err != nil {
		return fmt.Errorf("SCHED_IDLE: %w", err)
	}
	for {
	}
}

// schedIdle is the SCHED_IDLE policy (linux/sched.h).
const schedIdle = 5

// echoMain serves an echo on -listen: every byte read is written back.
func echoMain(args []string) error {
	fs := flag.NewFlagSet("echo", flag.ContinueOnError)
	addr := fs.String("listen", "[::]:7000", "address to listen on")
	if err := fs.Parse(args); err != nil {
		return err
	}
	l, err := net.Listen("tcp", *addr)
	if err != nil {
		return err
	}
	fmt.Println("ready")
	for {
		c, err := l.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer c.Close()
			buf := make([]byte, 4096)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					if _, werr := c.Write(buf[:n]); werr != nil {
						return
					}
				}
				if err != nil {
					return
				}
			}
		}()
	}
}

// rrResult is what `meshbench rr` prints.
type rrResult struct {
	N      int     `json:"n"`
	P50us  float64 `json:"p50_us"`
	P90us  float64 `json:"p90_us"`
	P99us  float64 `json:"p99_us"`
	MeanUs float64 `json:"mean_us"`
	// LatUs is every round trip's latency, with -samples: a slice of the
	// sliced test is merged with the others by its round trips.
	LatUs []float64 `json:"lat_us,omitempty"`
}

// rrMain makes -n 1-byte round trips on one connection, after a warm-up,
// and prints their latency percentiles.
func rrMain(args []string) error {
	fs := flag.NewFlagSet("rr", flag.ContinueOnError)
	addr := fs.String("addr", "", "echo server address")
	n := fs.Int("n", 10000, "round trips measured")
	warm := fs.Int("warmup", 500, "round trips before measuring")
	samples := fs.Bool("samples", false, "also print every round trip's latency")
	if err := fs.Parse(args); err != nil {
		return err
	}
	c, err := net.DialTimeout("tcp", *addr, 5*time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Minute))
	b := []byte{'x'}
	rt := func() error {
		if _, err := c.Write(b); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			return fmt.Errorf("read echo: %w", err)
		}
		return nil
	}
	for range *warm {
		if err := rt(); err != nil {
			return err
		}
	}
	lat := make([]float64, *n)
	for i := range lat {
		t0 := time.Now()
		if err := rt(); err != nil {
			return err
		}
		lat[i] = float64(time.Since(t0)) / 1e3
	}
	res := rrStats(lat)
	if *samples {
		res.LatUs = lat
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// rrStats sorts lat (µs) and gives its percentiles and mean.
func rrStats(lat []float64) rrResult {
	slices.Sort(lat)
	var sum float64
	for _, l := range lat {
		sum += l
	}
	at := func(q float64) float64 { return lat[int(q*float64(len(lat)-1))] }
	return rrResult{N: len(lat), P50us: at(0.50), P90us: at(0.90), P99us: at(0.99), MeanUs: sum / float64(len(lat))}
}

// cpsResult is what `meshbench cps` prints.
type cpsResult struct {
	Conns    int64   `json:"conns"`
	Errors   int64   `json:"errors"`
	FirstErr string  `json:"first_error,omitempty"`
	Seconds  float64 `json:"seconds"`
	PerSec   float64 `json:"per_sec"`
}

// cpsMain opens connections for -d: connect, 1-byte echo, close, by -c
// clients in parallel, and prints how many completed per second.
func cpsMain(args []string) error {
	fs := flag.NewFlagSet("cps", flag.ContinueOnError)
	addr := fs.String("addr", "", "echo server address")
	d := fs.Duration("d", 2*time.Second, "how long")
	conc := fs.Int("c", 1, "clients in parallel")
	if err := fs.Parse(args); err != nil {
		return err
	}
	var ok, bad atomic.Int64
	var firstErr atomic.Value
	start := time.Now()
	deadline := start.Add(*d)
	var wg sync.WaitGroup
	for range *conc {
		wg.Go(func() {
			b := []byte{'x'}
			for time.Now().Before(deadline) {
				err := func() error {
					c, err := net.DialTimeout("tcp", *addr, 2*time.Second)
					if err != nil {
						return err
					}
					defer c.Close()
					_ = c.SetDeadline(time.Now().Add(2 * time.Second))
					if _, err := c.Write(b); err != nil {
						return err
					}
					_, err = io.ReadFull(c, b)
					return err
				}()
				if err != nil {
					bad.Add(1)
					firstErr.CompareAndSwap(nil, err.Error())
					time.Sleep(time.Millisecond)
					continue
				}
				ok.Add(1)
			}
		})
	}
	wg.Wait()
	secs := time.Since(start).Seconds()
	res := cpsResult{Conns: ok.Load(), Errors: bad.Load(), Seconds: secs, PerSec: float64(ok.Load()) / secs}
	if e, _ := firstErr.Load().(string); e != "" {
		res.FirstErr = e
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// idleMain opens -n connections, proves each carries data with a 1-byte
// echo, prints "ready <n>", and holds them until standard input closes.
func idleMain(args []string) error {
	fs := flag.NewFlagSet("idle", flag.ContinueOnError)
	addr := fs.String("addr", "", "echo server address")
	n := fs.Int("n", 1000, "connections")
	if err := fs.Parse(args); err != nil {
		return err
	}
	conns := make([]net.Conn, 0, *n)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	b := []byte{'x'}
	for i := range *n {
		c, err := net.DialTimeout("tcp", *addr, 5*time.Second)
		if err != nil {
			return fmt.Errorf("connection %d: %w", i, err)
		}
		conns = append(conns, c)
		_ = c.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := c.Write(b); err != nil {
			return fmt.Errorf("connection %d: write: %w", i, err)
		}
		if _, err := io.ReadFull(c, b); err != nil {
			return fmt.Errorf("connection %d: read echo: %w", i, err)
		}
		_ = c.SetDeadline(time.Time{})
	}
	fmt.Printf("ready %d\n", len(conns))
	_, _ = io.Copy(io.Discard, os.Stdin)
	return nil
}

// probeResult is what `meshbench probe` prints when a connection first
// gets its answer.
type probeResult struct {
	Attempts int `json:"attempts"`
	// SuccessStart is when the first successful attempt began (its SYN);
	// PrevStart when the last failed one began: the change happened
	// between the two.
	SuccessStart int64  `json:"success_start_unix_ns"`
	SuccessEnd   int64  `json:"success_end_unix_ns"`
	PrevStart    int64  `json:"prev_start_unix_ns"`
	LastErr      string `json:"last_error"`
}

// probeMain tries connect + 1-byte echo every -interval until one succeeds.
// It prints "ready" after the first failed attempt (the state before the
// change is established), then the result as JSON. A success on the first
// attempt is an error: nothing was measured.
func probeMain(args []string) error {
	fs := flag.NewFlagSet("probe", flag.ContinueOnError)
	addr := fs.String("addr", "", "echo server address (one that answers only meshed clients)")
	interval := fs.Duration("interval", time.Millisecond, "pause between attempts")
	timeout := fs.Duration("timeout", 60*time.Second, "give up after")
	if err := fs.Parse(args); err != nil {
		return err
	}
	attempt := func() error {
		c, err := net.DialTimeout("tcp", *addr, 250*time.Millisecond)
		if err != nil {
			return err
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(250 * time.Millisecond))
		b := []byte{'x'}
		if _, err := c.Write(b); err != nil {
			return err
		}
		_, err = io.ReadFull(c, b)
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	var res probeResult
	w := bufio.NewWriter(os.Stdout)
	for ctx.Err() == nil {
		start := time.Now()
		err := attempt()
		res.Attempts++
		if err == nil {
			if res.Attempts == 1 {
				return errors.New("the first attempt already succeeded: the path was meshed before the change")
			}
			res.SuccessStart, res.SuccessEnd = start.UnixNano(), time.Now().UnixNano()
			if err := json.NewEncoder(w).Encode(res); err != nil {
				return err
			}
			return w.Flush()
		}
		res.PrevStart, res.LastErr = start.UnixNano(), err.Error()
		if res.Attempts == 1 {
			fmt.Fprintln(w, "ready")
			_ = w.Flush()
		}
		time.Sleep(*interval)
	}
	return fmt.Errorf("no attempt succeeded within %s (%d attempts, last error: %s)", *timeout, res.Attempts, res.LastErr)
}
