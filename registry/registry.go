package registry

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

// MaxIndexBytes caps an index document (Ubuntu's released download stream
// is a few MiB).
const MaxIndexBytes = 64 << 20

// readTimeout bounds one read of one index.
const readTimeout = 60 * time.Second

// Registry is the merged content of the configured indexes. Its methods
// are safe for concurrent use.
type Registry struct {
	indexes []string
	client  *http.Client
	log     *slog.Logger

	mu      sync.Mutex
	content map[string][]Image // last good content, by index
	failing map[string]bool    // indexes in a failure streak (logged once)
	merged  []Image            // sorted by ImageID, first index wins
	byID    map[string]Image
}

// New returns a registry of indexes (URLs or absolute paths), empty until
// Refresh. client nil means http.DefaultClient; log nil discards.
func New(indexes []string, client *http.Client, log *slog.Logger) *Registry {
	if client == nil {
		client = http.DefaultClient
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Registry{indexes: indexes, client: client, log: log,
		content: map[string][]Image{}, failing: map[string]bool{}, byID: map[string]Image{}}
}

// Refresh reads every index once. One that cannot be read or parsed keeps
// its last good content; the failure is logged at the start of a streak
// only, and the end of a streak is logged too. It returns the errors of
// this round, joined (their messages carry only redacted locations).
func (r *Registry) Refresh(ctx context.Context) error {
	var errs []error
	for _, ix := range r.indexes {
		images, err := r.read(ctx, ix)
		r.mu.Lock()
		if err != nil {
			errs = append(errs, err)
			if !r.failing[ix] {
				r.failing[ix] = true
				r.log.Warn("registry index cannot be read; keeping its last good content", "index", Redact(ix), "err", err)
			}
		} else {
			if r.failing[ix] {
				r.log.Info("registry index readable again", "index", Redact(ix), "images", len(images))
			}
			delete(r.failing, ix)
			r.content[ix] = images
		}
		r.mu.Unlock()
	}
	r.merge()
	return errors.Join(errs...)
}

// Run refreshes every interval until ctx ends (the first refresh at once).
func (r *Registry) Run(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		r.Refresh(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (r *Registry) merge() {
	r.mu.Lock()
	defer r.mu.Unlock()
	byID := map[string]Image{}
	for _, ix := range r.indexes {
		for _, im := range r.content[ix] {
			if _, dup := byID[im.ImageID]; !dup {
				byID[im.ImageID] = im
			}
		}
	}
	merged := make([]Image, 0, len(byID))
	for _, im := range byID {
		merged = append(merged, im)
	}
	sort.Slice(merged, func(i, j int) bool { return merged[i].ImageID < merged[j].ImageID })
	r.merged, r.byID = merged, byID
}

// List returns every image, sorted by ImageID. The slice is shared: do not
// modify it.
func (r *Registry) List() []Image {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.merged
}

// Get returns the image with id.
func (r *Registry) Get(id string) (Image, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	im, ok := r.byID[id]
	return im, ok
}

// read fetches and parses one index. Its errors name the redacted
// location and never wrap a *url.Error, whose text quotes the whole URL.
func (r *Registry) read(ctx context.Context, ix string) ([]Image, error) {
	shown := Redact(ix)
	var data []byte
	var err error
	if strings.HasPrefix(ix, "/") {
		data, err = readFile(ix)
	} else {
		data, err = r.fetch(ctx, ix)
	}
	if err != nil {
		return nil, fmt.Errorf("reading index %s: %v", shown, err)
	}
	images, err := Parse(data, ix)
	if err != nil {
		return nil, fmt.Errorf("index %s: %v", shown, err)
	}
	return images, nil
}

func readFile(p string) ([]byte, error) {
	f, err := os.Open(p)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return readCapped(f)
}

func (r *Registry) fetch(ctx context.Context, ix string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, readTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, ix, nil)
	if err != nil {
		return nil, errors.New("not a valid URL")
	}
	resp, err := r.client.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the cause, without the URL's text
		}
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP status %s", resp.Status)
	}
	return readCapped(resp.Body)
}

func readCapped(rd io.Reader) ([]byte, error) {
	data, err := io.ReadAll(io.LimitReader(rd, MaxIndexBytes+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxIndexBytes {
		return nil, fmt.Errorf("larger than %d bytes", MaxIndexBytes)
	}
	return data, nil
}
