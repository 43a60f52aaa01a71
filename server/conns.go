package server

import (
	"context"
	"crypto/tls"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"

	"vmhost/auth"
)

// The server keeps connections of two kinds. Only a connection that has
// carried a request with a valid API key ("keyed") is the server's to
// keep: it may idle for requestLimits.idle and is never evicted. Every
// other connection is evictable, and a request without a valid key closes
// its connection once answered, so sockets opened by clients without a
// key (idle, trickling headers, or asking /healthz) can never starve
// keyed clients of connections.

// listenerLimits bound the connections of one listener.
//
// Evicting oldest first gives a fresh connection time to show its key: a
// client with one sends its request right after connecting, while the
// connections that make room are those that sat without one (idle, or
// trickling headers).
type listenerLimits struct {
	// maxConns bounds the connections open at once. When it is reached, a
	// new connection evicts the oldest connection not keyed and at least
	// grace old, of the source holding the most; when none is that old
	// yet, the new one waits (and the listen backlog behind it) until one
	// is, or until one closes. So when every open connection is keyed,
	// new ones wait in the backlog, and connections of clients that are
	// about to show their key are not evicted by the next ones.
	maxConns int
	// maxUnkeyedPerSource bounds the connections not keyed from one
	// source (an IPv4 address, an IPv6 /64): a new connection past it
	// evicts the source's own oldest one, whatever its age. So one source
	// can neither push out another's connections nor hold the listener
	// up, and a keyed client sharing the source with a flood still gets
	// in: its connection is evicted only after maxUnkeyedPerSource newer
	// ones, long after it showed its key. Zero: no bound per source (a
	// unix socket has one source).
	maxUnkeyedPerSource int
	// grace is the age at which a connection not keyed may be evicted to
	// make room in a full listener.
	grace time.Duration
}

var (
	// networkLimits are the limits of the listener of --listen.
	networkLimits = listenerLimits{maxConns: 256, maxUnkeyedPerSource: 64, grace: time.Second}
	// localLimits are those of the local socket (<run>/api.sock, mode
	// 0600), which has connections of its own, so local operators get in
	// whatever holds the network listener.
	localLimits = listenerLimits{maxConns: 64, grace: time.Second}
)

// requestLimits bound each request, on every listener.
type requestLimits struct {
	// readHeader bounds the wait for a request's headers (and a TLS
	// handshake); a connection that trickles them (slowloris) is closed at
	// the deadline. Request bodies are bounded by the API (a deadline per
	// body), not here: a server-wide read deadline would also end event
	// streams and log follows.
	readHeader time.Duration
	// idle is how long a keyed connection may idle between requests.
	idle time.Duration
	// maxHeaderBytes bounds a request's headers, and so what a slow
	// client makes the server buffer per connection.
	maxHeaderBytes int
}

var defaultRequestLimits = requestLimits{readHeader: 10 * time.Second, idle: 2 * time.Minute, maxHeaderBytes: 64 << 10}

// limitListener returns ln under lim.
func limitListener(ln net.Listener, lim listenerLimits) *limitedListener {
	return &limitedListener{Listener: ln, max: lim.maxConns, perSource: lim.maxUnkeyedPerSource, grace: lim.grace,
		unkeyed: map[string][]*limitedConn{}, freed: make(chan struct{}), closed: make(chan struct{})}
}

type limitedListener struct {
	net.Listener
	max, perSource int
	grace          time.Duration

	mu   sync.Mutex
	open int
	// unkeyed are the open connections not keyed, by source, oldest
	// first; nUnkeyed counts them all.
	unkeyed  map[string][]*limitedConn
	nUnkeyed int
	// freed is closed (and replaced) whenever a connection goes.
	freed chan struct{}

	closed    chan struct{}
	closeOnce sync.Once
}

// limitedConn is a connection a limitedListener counts.
type limitedConn struct {
	net.Conn
	l        *limitedListener
	source   string
	accepted time.Time
	// keyed and gone are guarded by l.mu; gone is set once the
	// connection no longer counts (closed or evicted).
	keyed, gone bool
}

// Accept waits until a connection may be let in (a slot is free, or a
// connection not keyed may be taken), accepts one and makes room for it.
func (l *limitedListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	for l.open >= l.max && l.nUnkeyed == 0 {
		if err := l.waitLocked(0); err != nil {
			return nil, err
		}
	}
	l.mu.Unlock()
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	lc := &limitedConn{Conn: c, l: l, source: sourceOf(c.RemoteAddr())}
	l.mu.Lock()
	var victim *limitedConn
	for {
		var wait time.Duration
		victim, wait = l.makeRoomLocked(lc.source, time.Now())
		if victim != nil || l.open < l.max {
			break
		}
		// No room yet: hold this connection (and the backlog) until one
		// closes or becomes evictable.
		if err := l.waitLocked(wait); err != nil {
			c.Close()
			return nil, err
		}
	}
	lc.accepted = time.Now()
	l.open++
	l.unkeyed[lc.source] = append(l.unkeyed[lc.source], lc)
	l.nUnkeyed++
	l.mu.Unlock()
	if victim != nil {
		victim.Conn.Close() // its server goroutine sees the error and ends
	}
	return lc, nil
}

// makeRoomLocked decides for a new connection from source, at now: the
// connection it evicts (already off the books), or, when the listener is
// full and nothing is evictable yet, how long until something is (0: only
// a close can make room).
func (l *limitedListener) makeRoomLocked(source string, now time.Time) (victim *limitedConn, wait time.Duration) {
	evictable := func(c *limitedConn) bool { return now.Sub(c.accepted) >= l.grace }
	if cs := l.unkeyed[source]; l.perSource > 0 && source != "" && len(cs) >= l.perSource {
		l.dropLocked(cs[0])
		return cs[0], 0
	}
	if l.open < l.max {
		return nil, 0
	}
	var busiest []*limitedConn
	var soonest time.Duration
	for _, cs := range l.unkeyed {
		if evictable(cs[0]) {
			if len(cs) > len(busiest) {
				busiest = cs
			}
		} else if left := l.grace - now.Sub(cs[0].accepted); soonest == 0 || left < soonest {
			soonest = left
		}
	}
	if busiest == nil {
		return nil, soonest
	}
	l.dropLocked(busiest[0])
	return busiest[0], 0
}

// waitLocked waits, l.mu held, for a connection to go, for d (0: no
// bound), or for the listener to close (then it returns net.ErrClosed
// with l.mu released).
func (l *limitedListener) waitLocked(d time.Duration) error {
	freed := l.freed
	l.mu.Unlock()
	var timeout <-chan time.Time
	if d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		timeout = t.C
	}
	select {
	case <-freed:
	case <-timeout:
	case <-l.closed:
		return net.ErrClosed
	}
	l.mu.Lock()
	return nil
}

// dropLocked makes c stop counting; l.mu is held.
func (l *limitedListener) dropLocked(c *limitedConn) {
	if c.gone {
		return
	}
	c.gone = true
	l.open--
	if !c.keyed {
		l.forgetUnkeyedLocked(c)
	}
	close(l.freed)
	l.freed = make(chan struct{})
}

func (l *limitedListener) forgetUnkeyedLocked(c *limitedConn) {
	cs := l.unkeyed[c.source]
	for i, x := range cs {
		if x == c {
			cs = append(cs[:i:i], cs[i+1:]...)
			l.nUnkeyed--
			break
		}
	}
	if len(cs) == 0 {
		delete(l.unkeyed, c.source)
	} else {
		l.unkeyed[c.source] = cs
	}
}

// Close also ends an Accept waiting for room.
func (l *limitedListener) Close() error {
	l.closeOnce.Do(func() { close(l.closed) })
	return l.Listener.Close()
}

// Close closes the connection and gives its slot back (once, however
// often it is called, and not at all after an eviction took it).
func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.l.mu.Lock()
	c.l.dropLocked(c)
	c.l.mu.Unlock()
	return err
}

// markKeyed records that c carried a request with a valid key: it is no
// longer evictable.
func (c *limitedConn) markKeyed() {
	l := c.l
	l.mu.Lock()
	defer l.mu.Unlock()
	if c.keyed || c.gone {
		return
	}
	c.keyed = true
	l.forgetUnkeyedLocked(c)
}

// sourceOf is what maxUnkeyedPerSource counts by: the IPv4 address, or
// the /64 of an IPv6 one (one host commonly holds a whole /64); "" for a
// unix socket's peer.
func sourceOf(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok {
		return ""
	}
	ip, ok := netip.AddrFromSlice(ta.IP)
	if !ok {
		return a.String()
	}
	ip = ip.Unmap()
	if ip.Is4() {
		return ip.String()
	}
	return netip.PrefixFrom(ip, 64).Masked().String()
}

// connKey is the context key of a request's *limitedConn.
type connKey struct{}

// connContext stores the request's connection (under its TLS layer) in the
// context, for keyedOnly.
func connContext(ctx context.Context, c net.Conn) context.Context {
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	if lc, ok := c.(*limitedConn); ok {
		ctx = context.WithValue(ctx, connKey{}, lc)
	}
	return ctx
}

// keyedOnly keeps connections open only for requests with a valid key:
// such a request marks its connection keyed (kept, never evicted); any
// other (a 401 to come, or /healthz) is answered with Connection: close.
// The key is checked here as well as in the API, which decides what the
// request may do; a key with a too narrow scope (403) still keys the
// connection.
type keyedOnly struct {
	keys *auth.Keyring
	next http.Handler
}

func (k keyedOnly) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if key, _ := k.keys.Authorize(r.Header.Get("Authorization"), "", false); key != nil {
		if lc, ok := r.Context().Value(connKey{}).(*limitedConn); ok {
			lc.markKeyed()
		}
	} else {
		w.Header().Set("Connection", "close")
	}
	k.next.ServeHTTP(w, r)
}
