package disk

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"vmhost/internal/atomicfile"
	"vmhost/qcow2"
)

// Defaults for CacheOptions.
const (
	DefaultMaxBytes     = 64 << 30
	DefaultMaxRedirects = 5
	DefaultIdleTimeout  = 60 * time.Second
)

// ErrIdleTimeout is wrapped by Fetch's error when the server sent nothing
// for CacheOptions.IdleTimeout.
var ErrIdleTimeout = errors.New("download idle timeout")

// DeniedError is a connection refused, before it was made, because its
// address is in one of CacheOptions.Deny (the config's fetch_deny).
type DeniedError struct {
	Addr netip.Addr
	Rule netip.Prefix
}

func (e *DeniedError) Error() string {
	return fmt.Sprintf("address %s is denied by fetch_deny rule %s", e.Addr, e.Rule)
}

// ErrDigestMismatch is wrapped by Fetch's error when the body's sha256 is
// not the expected one; the message carries both digests.
var ErrDigestMismatch = errors.New("content sha256 mismatch")

// HTTPStatusError is a download answered with a status other than 200
// (after redirects).
type HTTPStatusError struct {
	StatusCode int
	Status     string // e.g. "404 Not Found"
}

func (e *HTTPStatusError) Error() string { return "HTTP status " + e.Status }

// progressInterval is the least time between two progress reports.
const progressInterval = 100 * time.Millisecond

// CacheOptions are the knobs of a Cache.
type CacheOptions struct {
	// MaxBytes caps the size of one image; a larger body (or
	// Content-Length) fails the download. 0 means DefaultMaxBytes.
	MaxBytes int64
	// MaxRedirects caps the redirects followed; 0 means
	// DefaultMaxRedirects, a negative value follows none.
	MaxRedirects int
	// IdleTimeout fails a download that receives nothing for this long,
	// from the request on (connecting and waiting for the headers
	// included); 0 means DefaultIdleTimeout.
	IdleTimeout time.Duration
	// Deny lists the networks no download may connect to. Every
	// connection, the redirects' included, is checked on its resolved
	// address just before it is made, so a name that resolves (or later
	// rebinds) to a denied address is refused too. nil denies nothing.
	Deny []netip.Prefix
	// Client makes the requests; nil means a client with no overall
	// timeout (images are large; callers bound a download with ctx).
	// Its CheckRedirect is replaced by the redirect cap. Its Transport
	// must be nil or an *http.Transport, whose dialer is replaced by one
	// that applies Deny and whose proxy setting is cleared: a proxy would
	// connect on our behalf, where Deny cannot see the address.
	Client *http.Client
	// MaxTotalBytes bounds the cache: after each download, the least
	// recently used images that are neither pinned (Use) nor being
	// downloaded are removed until the cache fits. 0 means no bound.
	MaxTotalBytes int64
}

// Cache is the verified image cache in one directory. Its methods are safe
// for concurrent use.
type Cache struct {
	dir    string
	opts   CacheOptions
	client *http.Client

	mu       sync.Mutex
	inflight map[string]*download // by digest
	pins     map[string]int       // Use counts, by digest
}

// NewCache returns a cache keeping images in dir, creating dir (0700) if
// needed. Temp files of downloads interrupted by a crash (atomicfile's, and
// the ".download-*" of older versions) are removed.
func NewCache(dir string, opts CacheOptions) (*Cache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("creating image cache: %w", err)
	}
	if ents, err := os.ReadDir(dir); err == nil {
		for _, e := range ents {
			if name := e.Name(); atomicfile.IsTemp(name) || strings.HasPrefix(name, ".download-") {
				os.Remove(filepath.Join(dir, name))
			}
		}
	}
	if opts.MaxBytes == 0 {
		opts.MaxBytes = DefaultMaxBytes
	}
	if opts.MaxRedirects == 0 {
		opts.MaxRedirects = DefaultMaxRedirects
	}
	if opts.IdleTimeout == 0 {
		opts.IdleTimeout = DefaultIdleTimeout
	}
	client := &http.Client{}
	if opts.Client != nil {
		c := *opts.Client
		client = &c
	}
	var transport *http.Transport
	switch t := client.Transport.(type) {
	case nil:
		transport = http.DefaultTransport.(*http.Transport).Clone()
	case *http.Transport:
		transport = t.Clone()
	default:
		return nil, fmt.Errorf("image cache: client transport %T is not an *http.Transport", t)
	}
	deny := slices.Clone(opts.Deny)
	dialer := &net.Dialer{
		Timeout:   30 * time.Second,
		KeepAlive: 30 * time.Second,
		Control: func(network, address string, _ syscall.RawConn) error {
			return checkDeny(deny, address)
		},
	}
	transport.DialContext = dialer.DialContext
	transport.Proxy = nil
	client.Transport = transport
	maxRedirects := max(opts.MaxRedirects, 0)
	client.CheckRedirect = func(req *http.Request, via []*http.Request) error {
		if len(via) > maxRedirects {
			return fmt.Errorf("stopped after %d redirects", maxRedirects)
		}
		if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
			return fmt.Errorf("redirect to unsupported scheme %q", req.URL.Scheme)
		}
		return nil
	}
	return &Cache{dir: dir, opts: opts, client: client, inflight: map[string]*download{}, pins: map[string]int{}}, nil
}

// checkDeny refuses address ("ip:port", as a dialer's Control sees it
// once the name is resolved) when a deny rule contains it. IPv4-mapped IPv6
// addresses count as IPv4, and a zone is ignored (netip.Prefix.Contains
// never matches a zoned address, which would let fe80::1%eth0 through).
func checkDeny(deny []netip.Prefix, address string) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("checking fetch_deny: unexpected address %q: %w", address, err)
	}
	addr := ap.Addr().Unmap().WithZone("")
	for _, rule := range deny {
		if rule.Contains(addr) {
			return &DeniedError{Addr: addr, Rule: rule}
		}
	}
	return nil
}

// Path is where the image with the given sha256 (lower-case hex) lives
// once fetched.
func (c *Cache) Path(sha256hex string) string {
	return filepath.Join(c.dir, "sha256-"+sha256hex+".qcow2")
}

// Has reports whether the image with the given digest is in the cache.
func (c *Cache) Has(sha256hex string) bool {
	_, err := os.Stat(c.Path(sha256hex))
	return err == nil
}

// download is one transfer shared by every Fetch of its digest.
type download struct {
	done chan struct{}
	err  error

	cancel  context.CancelFunc
	mu      sync.Mutex
	waiters int
	watch   map[int]func(done, total int64)
	nextW   int
}

// Fetch returns the path of the image whose content has the sha256
// sha256hex (64 hex digits), downloading it from rawURL if the cache lacks
// it. Concurrent Fetches of one digest share a single download; the
// download is cancelled only when every caller waiting on it has gone
// (ctx ended). progress, if not nil, is called from the download's
// goroutine with the bytes received so far and the total (-1 when the
// server sent no length), at most every 100 ms and once at the end; it
// must not block.
//
// Errors name the cause: an HTTP status (*HTTPStatusError), a content
// sha256 mismatch (ErrDigestMismatch), a body that is not a qcow2 image
// (qcow2.ErrNotQcow2) or that has a backing file, a body over the size
// cap, a truncated body, too many redirects. No file is left behind on
// failure.
func (c *Cache) Fetch(ctx context.Context, rawURL, sha256hex string, progress func(done, total int64)) (string, error) {
	sha256hex = strings.ToLower(sha256hex)
	if len(sha256hex) != 64 || strings.Trim(sha256hex, "0123456789abcdef") != "" {
		return "", fmt.Errorf("fetching image: content sha256 %q is not 64 hex digits", sha256hex)
	}
	final := c.Path(sha256hex)
	if _, err := os.Stat(final); err == nil {
		c.touch(sha256hex)
		return final, nil
	}
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return "", fmt.Errorf("fetching image: url %q is not an http or https URL", displayURL(rawURL))
	}

	c.mu.Lock()
	d := c.inflight[sha256hex]
	if d == nil {
		dctx, cancel := context.WithCancel(context.Background())
		d = &download{done: make(chan struct{}), cancel: cancel, watch: map[int]func(int64, int64){}}
		c.inflight[sha256hex] = d
		go func() {
			d.err = c.download(dctx, rawURL, sha256hex, d)
			cancel()
			c.mu.Lock()
			if c.inflight[sha256hex] == d {
				delete(c.inflight, sha256hex)
			}
			c.mu.Unlock()
			close(d.done)
		}()
	}
	d.mu.Lock()
	d.waiters++
	w := d.nextW
	d.nextW++
	if progress != nil {
		d.watch[w] = progress
	}
	d.mu.Unlock()
	c.mu.Unlock()

	// leave drops this caller; the last one to go cancels the download
	// and forgets it, so a later Fetch starts afresh. It reports whether
	// it was the last.
	leave := func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		d.mu.Lock()
		defer d.mu.Unlock()
		delete(d.watch, w)
		d.waiters--
		if d.waiters == 0 {
			d.cancel()
			if c.inflight[sha256hex] == d {
				delete(c.inflight, sha256hex)
			}
			return true
		}
		return false
	}
	select {
	case <-d.done:
		if leave() && d.err == nil {
			c.evict(sha256hex)
		}
		if d.err != nil {
			return "", d.err
		}
		return final, nil
	case <-ctx.Done():
		if leave() {
			// The cancelled download stops at its next read and removes
			// its temp file; wait, so that when Fetch returns nothing it
			// made is left (a force delete must not race its cleanup).
			<-d.done
		}
		return "", fmt.Errorf("fetching image %s: %w", displayURL(rawURL), ctx.Err())
	}
}

func (d *download) report(done, total int64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, fn := range d.watch {
		fn(done, total)
	}
}

// displayURL is rawURL as errors (and so views and logs) show it: without
// user info and with the query replaced, since either may carry a
// credential (basic auth, a presigned URL's token).
func displayURL(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return "(unparsable URL)"
	}
	u.User = nil
	if u.RawQuery != "" || u.ForceQuery {
		u.RawQuery, u.ForceQuery = "REDACTED", false
	}
	u.Fragment, u.RawFragment = "", ""
	return u.String()
}

// download fetches rawURL into the cache as sha256hex.
func (c *Cache) download(ctx context.Context, rawURL, sha256hex string, d *download) (err error) {
	// Every byte received re-arms the idle timer; when it fires, the
	// request's context ends with ErrIdleTimeout as its cause, which
	// interrupts a dial, a wait for headers or a body read alike.
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	idle := time.AfterFunc(c.opts.IdleTimeout, func() {
		cancel(fmt.Errorf("%w: nothing received for %s", ErrIdleTimeout, c.opts.IdleTimeout))
	})
	defer idle.Stop()
	defer func() {
		if cause := context.Cause(ctx); err != nil && errors.Is(cause, ErrIdleTimeout) {
			err = cause
		}
		if err != nil {
			// net/http's *url.Error repeats the whole URL, query included.
			if ue, ok := err.(*url.Error); ok {
				err = fmt.Errorf("%s: %w", ue.Op, ue.Err)
			}
			err = fmt.Errorf("fetching image %s: %w", displayURL(rawURL), err)
		}
	}()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, rawURL, nil)
	if err != nil {
		return err
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &HTTPStatusError{StatusCode: resp.StatusCode, Status: resp.Status}
	}
	total := resp.ContentLength // -1 when unknown
	if total > c.opts.MaxBytes {
		return fmt.Errorf("image of %d bytes exceeds the size cap of %d bytes", total, c.opts.MaxBytes)
	}

	// The body streams into a temp file beside the final path, is hashed
	// and checked there, and only then renamed into place.
	return atomicfile.Fill(c.Path(sha256hex), 0o600, func(f *os.File) error {
		h := sha256.New()
		var n int64
		buf := make([]byte, 1<<20)
		last := time.Now()
		body := io.LimitReader(resp.Body, c.opts.MaxBytes+1)
		for {
			m, rerr := body.Read(buf)
			if m > 0 {
				idle.Reset(c.opts.IdleTimeout)
				// Hash while streaming: the file is never read back.
				h.Write(buf[:m])
				if _, err := f.Write(buf[:m]); err != nil {
					return err
				}
				n += int64(m)
				if n > c.opts.MaxBytes {
					return fmt.Errorf("body exceeds the size cap of %d bytes", c.opts.MaxBytes)
				}
				if now := time.Now(); now.Sub(last) >= progressInterval {
					last = now
					d.report(n, total)
				}
			}
			if errors.Is(rerr, io.EOF) {
				// Verifying and syncing a large file may outlast the
				// idle timeout; the network part is over.
				idle.Stop()
				break
			}
			if rerr != nil {
				if errors.Is(rerr, io.ErrUnexpectedEOF) && total >= 0 {
					return fmt.Errorf("truncated body: got %d of %d bytes: %w", n, total, rerr)
				}
				return fmt.Errorf("reading body after %d bytes: %w", n, rerr)
			}
		}
		if total >= 0 && n != total {
			return fmt.Errorf("truncated body: got %d of %d bytes", n, total)
		}
		d.report(n, total)

		if got := hex.EncodeToString(h.Sum(nil)); got != sha256hex {
			return fmt.Errorf("%w: expected %s, got %s", ErrDigestMismatch, sha256hex, got)
		}
		hdr, err := qcow2.ReadHeader(f)
		if err != nil {
			return fmt.Errorf("downloaded image: %w", err)
		}
		if err := hdr.CheckBase(); err != nil {
			return fmt.Errorf("downloaded image refused: %w", err)
		}
		return nil
	})
}
