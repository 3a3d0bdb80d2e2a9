package admin

import (
	"bytes"
	"cmp"
	"context"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/common/expfmt"
)

// A scrape's answer costs the agent in proportion to its series, and
// mostly to write them: about 1.1 s of CPU for the 18 MB of text of 5000
// istio_tcp_* series (gzip 0.9 s, gathering alone 0.23 s). Every pod can
// reach the metrics port, and bounding the scrapes in flight (4, 2 per
// address) bounded how many run at once, not how often: one pod asking
// again as soon as each answer came kept two of the node agent's cores
// busy rendering metrics, beside the data path of every pod of the node.
//
// So answers are rendered by scrapeCache, one at a time, and renderings
// may take at most 1/scrapeShare of the time on average, with a credit of
// scrapeBurst for an agent that renders seldom: an honest Prometheus (an HA
// pair, a few jobs, every 15 s or more) always gets a rendering made for
// it, while under a flood a scrape gets the last rendering of its kind,
// made moments before (at most scrapeKeep).
const (
	scrapeShare = 4
	scrapeBurst = 5 * time.Second
	// scrapeKeep is how long a rendering may serve later scrapes. A scrape
	// whose kind has none that recent waits for a new one, and goes
	// before scrapes that have one: so a flood of one kind of scrape,
	// which uses up the budget as soon as it is there, leaves another
	// kind (Prometheus's) answers at most this old, each got within a
	// few renderings' time.
	scrapeKeep = 10 * time.Second
)

// scrapeFormats are the formats the metrics endpoint offers, in order of
// preference: Prometheus's delimited protocol buffers, or text.
var scrapeFormats = []expfmt.Format{expfmt.NewFormat(expfmt.TypeProtoDelim), expfmt.NewFormat(expfmt.TypeTextPlain)}

// scrapeKey is the kind of answer a scrape wants; a rendering serves every
// scrape of its kind. Other request details (name[] filters, escaping
// schemes, other encodings) are not honoured, or a caller could make each
// of its scrapes a rendering of its own.
type scrapeKey struct{ proto, gzip bool }

func scrapeKeyOf(r *http.Request) scrapeKey {
	return scrapeKey{
		proto: expfmt.NegotiateAccept(r.Header, scrapeFormats...).FormatType() == expfmt.TypeProtoDelim,
		gzip:  acceptsGzip(r.Header.Get("Accept-Encoding")),
	}
}

// acceptsGzip reports whether an Accept-Encoding value lists gzip with a
// weight other than 0.
func acceptsGzip(v string) bool {
	for _, item := range strings.Split(v, ",") {
		name, params, _ := strings.Cut(item, ";")
		if !strings.EqualFold(strings.TrimSpace(name), "gzip") {
			continue
		}
		if k, q, ok := strings.Cut(params, "="); ok && strings.EqualFold(strings.TrimSpace(k), "q") {
			if f, err := strconv.ParseFloat(strings.TrimSpace(q), 64); err == nil && f == 0 {
				return false
			}
		}
		return true
	}
	return false
}

// rendering is one answer of the registry's handler, kept for the scrapes
// of its kind.
type rendering struct {
	key    scrapeKey
	done   chan struct{} // closed once made
	at     time.Time
	status int
	header http.Header
	body   bytes.Buffer
}

// Header, WriteHeader and Write let the registry's handler write into r.
func (r *rendering) Header() http.Header { return r.header }
func (r *rendering) WriteHeader(code int) {
	if r.status == 0 {
		r.status = code
	}
}

func (r *rendering) Write(p []byte) (int, error) {
	r.WriteHeader(http.StatusOK)
	return r.body.Write(p)
}

// serve writes r as the answer to w.
func (r *rendering) serve(w http.ResponseWriter) {
	for k, v := range r.header {
		w.Header()[k] = v
	}
	w.WriteHeader(r.status)
	w.Write(r.body.Bytes()) // the client is gone if this fails
}

// scrapeCache serves scrapes from renderings of render (the registry's
// handler), made one at a time within the budget above. A scrape joins a
// rendering of its kind being made; otherwise it gets a new one if none is
// being made and the budget allows, else the last of its kind, else it
// waits for one.
type scrapeCache struct {
	render http.Handler
	now    func() time.Time
	// reused counts scrapes answered with an earlier rendering.
	reused func()
	// burst is the most credit, keep how long a rendering serves
	// (scrapeBurst and scrapeKeep but in tests).
	burst, keep time.Duration

	mu      sync.Mutex
	last    map[scrapeKey]*rendering
	current *rendering // being made; nil if none
	// waiting counts scrapes waiting for a rendering, having none of
	// their kind recent enough: one may start before any other.
	waiting int
	// credit is the render time that may be spent now (negative:
	// overdrawn), as of credited.
	credit   time.Duration
	credited time.Time
}

// newScrapeCache serves render's answers; burst is the most render time
// spent at once by an agent that renders seldom (0: scrapeBurst).
func newScrapeCache(render http.Handler, burst time.Duration, reused func()) *scrapeCache {
	burst = cmp.Or(burst, scrapeBurst)
	return &scrapeCache{render: render, now: time.Now, reused: reused, burst: burst, keep: scrapeKeep, last: map[scrapeKey]*rendering{}, credit: burst}
}

// refill brings credit up to date. Call with c.mu held.
func (c *scrapeCache) refill(now time.Time) {
	if !c.credited.IsZero() {
		c.credit = min(c.burst, c.credit+now.Sub(c.credited)/scrapeShare)
	}
	c.credited = now
}

func (c *scrapeCache) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := scrapeKeyOf(r)
	waited := false
	defer func() {
		if waited {
			c.mu.Lock()
			c.waiting--
			c.mu.Unlock()
		}
	}()
	for {
		c.mu.Lock()
		now := c.now()
		c.refill(now)
		cur := c.current
		if cur != nil && cur.key == key {
			c.mu.Unlock()
			select {
			case <-cur.done:
				cur.serve(w)
			case <-r.Context().Done():
			}
			return
		}
		last := c.last[key]
		recent := last != nil && now.Sub(last.at) <= c.keep
		if cur == nil && c.credit >= 0 && (!recent || c.waiting == 0) {
			rd := &rendering{key: key, done: make(chan struct{}), at: now, header: http.Header{}}
			c.current = rd
			c.mu.Unlock()
			c.make(rd)
			rd.serve(w)
			return
		}
		if recent {
			c.mu.Unlock()
			c.reused()
			last.serve(w)
			return
		}
		// Nothing recent of this kind to serve, and no rendering may
		// start now: wait for the one being made, or for credit.
		if !waited {
			waited = true
			c.waiting++
		}
		var wait <-chan struct{}
		var t *time.Timer
		if cur != nil {
			wait = cur.done
		} else {
			t = time.NewTimer(-c.credit * scrapeShare)
		}
		c.mu.Unlock()
		if t != nil {
			select {
			case <-t.C:
			case <-r.Context().Done():
				t.Stop()
				return
			}
			continue
		}
		select {
		case <-wait:
		case <-r.Context().Done():
			return
		}
	}
}

// make renders rd (c.current) with a request of its kind, charges the time
// it took and keeps it for later scrapes of its kind.
func (c *scrapeCache) make(rd *rendering) {
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, "/metrics", nil)
	req.Header.Set("Accept", string(scrapeFormats[1]))
	if rd.key.proto {
		req.Header.Set("Accept", string(scrapeFormats[0]))
	}
	if rd.key.gzip {
		req.Header.Set("Accept-Encoding", "gzip")
	}
	defer func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		now := c.now()
		c.refill(now)
		c.credit -= now.Sub(rd.at)
		c.current = nil
		if rd.status == 0 {
			rd.status = http.StatusInternalServerError // the handler panicked
		}
		if rd.status == http.StatusOK {
			c.last[rd.key] = rd
		}
		for k, old := range c.last {
			if now.Sub(old.at) > c.keep {
				delete(c.last, k)
			}
		}
		close(rd.done)
	}()
	c.render.ServeHTTP(rd, req)
}
