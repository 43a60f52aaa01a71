package disk

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"
	"time"
)

// ErrImageInUse is returned by Cache.Delete for an image a provision is
// using or downloading.
var ErrImageInUse = errors.New("image is in use by a provision")

// CacheEntry is one verified image in the cache. CachedAt is when it was
// downloaded (the file's mtime), LastUsedAt when a provision last used it
// (its atime, set by the cache itself, so a noatime mount changes
// nothing).
type CacheEntry struct {
	Digest     string // lower-case hex sha256
	SizeBytes  int64
	CachedAt   time.Time
	LastUsedAt time.Time
	InUse      bool
}

const cachePrefix, cacheSuffix = "sha256-", ".qcow2"

// Use pins the image with digest against Delete and eviction until release
// is called (once; later calls do nothing). Pin before Fetch and release
// once the image has been copied: between the two the file must stay.
func (c *Cache) Use(sha256hex string) (release func()) {
	sha256hex = strings.ToLower(sha256hex)
	c.mu.Lock()
	c.pins[sha256hex]++
	c.mu.Unlock()
	done := false
	return func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if done {
			return
		}
		done = true
		if c.pins[sha256hex]--; c.pins[sha256hex] <= 0 {
			delete(c.pins, sha256hex)
		}
	}
}

// inUseLocked reports whether digest is pinned or being downloaded. c.mu
// is held.
func (c *Cache) inUseLocked(digest string) bool {
	return c.pins[digest] > 0 || c.inflight[digest] != nil
}

// touch records a use of digest: its atime becomes now, its mtime (when it
// was cached) stays.
func (c *Cache) touch(digest string) {
	p := c.Path(digest)
	if fi, err := os.Stat(p); err == nil {
		os.Chtimes(p, time.Now(), fi.ModTime())
	}
}

// List returns the cached images, most recently used first.
func (c *Cache) List() ([]CacheEntry, error) {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return nil, fmt.Errorf("reading image cache: %w", err)
	}
	out := []CacheEntry{}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range ents {
		digest, ok := strings.CutPrefix(e.Name(), cachePrefix)
		if !ok {
			continue
		}
		if digest, ok = strings.CutSuffix(digest, cacheSuffix); !ok || len(digest) != 64 {
			continue
		}
		if ce, ok := c.entryLocked(digest); ok {
			out = append(out, ce)
		}
	}
	slices.SortFunc(out, func(a, b CacheEntry) int {
		if d := b.LastUsedAt.Compare(a.LastUsedAt); d != 0 {
			return d
		}
		return strings.Compare(a.Digest, b.Digest)
	})
	return out, nil
}

// Stat returns the entry of digest, if the image is cached.
func (c *Cache) Stat(sha256hex string) (CacheEntry, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.entryLocked(strings.ToLower(sha256hex))
}

func (c *Cache) entryLocked(digest string) (CacheEntry, bool) {
	fi, err := os.Stat(c.Path(digest))
	if err != nil || !fi.Mode().IsRegular() {
		return CacheEntry{}, false
	}
	ce := CacheEntry{Digest: digest, SizeBytes: fi.Size(), CachedAt: fi.ModTime().UTC(), LastUsedAt: fi.ModTime().UTC(), InUse: c.inUseLocked(digest)}
	if at, ok := accessTime(fi); ok && at.After(ce.LastUsedAt) {
		ce.LastUsedAt = at.UTC()
	}
	return ce, true
}

// Delete removes the cached image with digest: ErrImageInUse while a
// provision uses or downloads it, an error satisfying
// errors.Is(err, fs.ErrNotExist) when it is not cached.
func (c *Cache) Delete(sha256hex string) error {
	digest := strings.ToLower(sha256hex)
	if len(digest) != 64 || strings.Trim(digest, "0123456789abcdef") != "" {
		return fmt.Errorf("image %q: %w", sha256hex, fs.ErrNotExist)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inUseLocked(digest) {
		return fmt.Errorf("deleting cached image %s: %w", digest, ErrImageInUse)
	}
	if err := os.Remove(c.Path(digest)); err != nil {
		return fmt.Errorf("deleting cached image %s: %w", digest, err)
	}
	return nil
}

// evict removes least recently used images that are not in use until the
// cache fits MaxTotalBytes; keep (the image just fetched) stays whatever
// its size.
func (c *Cache) evict(keep string) {
	if c.opts.MaxTotalBytes <= 0 {
		return
	}
	ents, err := c.List()
	if err != nil {
		return
	}
	var total int64
	for _, e := range ents {
		total += e.SizeBytes
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(ents) - 1; i >= 0 && total > c.opts.MaxTotalBytes; i-- {
		e := ents[i]
		if e.Digest == keep || c.inUseLocked(e.Digest) {
			continue
		}
		if os.Remove(c.Path(e.Digest)) == nil {
			total -= e.SizeBytes
		}
	}
}

// Evict applies MaxTotalBytes now. The agent does not call it at start:
// a provision that recovery resumes may still need an image it has not
// pinned yet; the next download applies a lowered bound.
func (c *Cache) Evict() { c.evict("") }
