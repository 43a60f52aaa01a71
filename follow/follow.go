// Package follow reads a log that internal/rotlog writes (the older
// generation path.1, then path) and follows what is appended to it, across
// rotations, the way `tail -F` does: the console and workload logs the API
// serves with follow=true.
//
// A Reader opens the pair once and reads it as one stream: the rest of the
// generation in hand, then the newer ones. At the end it returns io.EOF;
// Changed then fires when the log's files change (a write, a rotation),
// told by inotify(7), so a follower waits for the writer without polling.
// A rotated generation is immutable (rotlog moves a file only between
// writes), so a reader that finds the log rotated reads the rest of the
// old file, then the new one from its start.
//
// A reader slower than the writer never slows it: it reads the files at
// its own pace, holding the generation it reads open. A reader that falls
// more than one rotation behind loses the generations it never opened and
// goes on with the oldest one still kept; a reader of records (the
// workload log's numbered chunks) sees the gap in their numbers.
//
// One Watcher (one inotify instance, one reading goroutine) serves every
// Reader made from it, with one watch per directory and one per followed
// file however many readers follow it; a watch goes with its last reader. Without
// inotify (other systems, or its limits reached) Changed never fires and
// only Read works: a caller that also waits for something else (the VM's
// changes, its context) still ends.
package follow

import (
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync"

	"vmhost/inotify"
	"vmhost/internal/nofollow"
)

// The watches: one per directory, for the log files appearing (a
// rotation's new file) and the directory going; one per followed file,
// for its writes. Writes to other files of the directory (an AppVM's disk
// images sit beside its workload log) make no events at all.
const (
	dirMask  = inotify.Create | inotify.MovedTo | inotify.DeleteSelf | inotify.MoveSelf | inotify.OnlyDir
	fileMask = inotify.Modify
)

// Watcher is one inotify instance for every Reader made from it. The zero
// value is not usable; call NewWatcher. It is safe for concurrent use.
type Watcher struct {
	once sync.Once
	in   *inotify.Watcher // nil when inotify is unavailable
	err  error

	mu     sync.Mutex
	closed bool
	dirs   map[string]*dirWatch
	// byWD maps a watch descriptor to its *dirWatch or *fileWatch.
	byWD map[int]any
}

// dirWatch is the watch of one directory and the files followed in it.
type dirWatch struct {
	dir   string
	wd    int
	files map[string]*fileWatch // by base name
}

// fileWatch is the watch of one followed file (its current inode; -1
// while there is none) and its readers.
type fileWatch struct {
	dw   *dirWatch
	base string
	wd   int
	subs map[*Reader]struct{}
}

// NewWatcher returns a Watcher; its inotify instance is made when the
// first Reader opens.
func NewWatcher() *Watcher {
	return &Watcher{dirs: map[string]*dirWatch{}, byWD: map[int]any{}}
}

// Close ends the inotify instance: readers still open keep reading, and
// their Changed no longer fires.
func (w *Watcher) Close() error {
	w.mu.Lock()
	w.closed = true
	w.mu.Unlock()
	w.once.Do(func() {}) // no instance after Close
	if w.in != nil {
		return w.in.Close()
	}
	return nil
}

func (w *Watcher) start() error {
	w.once.Do(func() {
		in, err := inotify.New()
		if err != nil {
			w.err = err
			return
		}
		w.in = in
		go w.run()
	})
	if w.in == nil && w.err == nil {
		return errors.New("follow: watcher closed")
	}
	return w.err
}

// run reads the events and pokes the readers they concern.
func (w *Watcher) run() {
	buf := make([]byte, 64<<10)
	for {
		evs, err := w.in.Read(buf)
		if err != nil {
			return
		}
		w.mu.Lock()
		for _, e := range evs {
			w.handle(e)
		}
		w.mu.Unlock()
	}
}

// handle routes one event; w.mu is held.
func (w *Watcher) handle(e inotify.Event) {
	if e.Mask&inotify.QOverflow != 0 {
		for _, dw := range w.dirs {
			dw.poke()
		}
		return
	}
	switch x := w.byWD[e.WD].(type) {
	case *fileWatch:
		if e.Mask&inotify.Ignored != 0 {
			delete(w.byWD, e.WD)
			if x.wd == e.WD {
				x.wd = -1
			}
		}
		x.poke()
	case *dirWatch:
		if e.Mask&inotify.Ignored != 0 {
			// The directory is gone: its readers may watch it again once
			// it is back (Rewatch).
			w.dropDir(x)
			x.poke()
			return
		}
		if fw := x.files[e.Name]; fw != nil {
			// A new file under the followed name (a rotation, or the
			// first write): its writes are what readers wait for now.
			w.watchFile(fw)
			fw.poke()
		} else if e.Name == "" {
			x.poke()
		}
	}
}

// watchFile (re)watches fw's current file; w.mu is held.
func (w *Watcher) watchFile(fw *fileWatch) {
	wd, err := w.in.Add(filepath.Join(fw.dw.dir, fw.base), fileMask)
	if err != nil {
		return // not there (yet): the directory's watch tells when it is
	}
	if fw.wd >= 0 && fw.wd != wd {
		// The previous file was rotated away; it no longer changes.
		delete(w.byWD, fw.wd)
		w.in.Remove(fw.wd)
	}
	fw.wd = wd
	w.byWD[wd] = fw
}

// dropDir forgets dw and its files' watches; w.mu is held.
func (w *Watcher) dropDir(dw *dirWatch) {
	delete(w.byWD, dw.wd)
	delete(w.dirs, dw.dir)
	for _, fw := range dw.files {
		if fw.wd >= 0 {
			delete(w.byWD, fw.wd)
			if !w.closed {
				w.in.Remove(fw.wd)
			}
		}
		for r := range fw.subs {
			r.watched = false
		}
	}
}

func (dw *dirWatch) poke() {
	for _, fw := range dw.files {
		fw.poke()
	}
}

func (fw *fileWatch) poke() {
	for r := range fw.subs {
		r.poke()
	}
}

// watch adds r to the watches of its file and directory, making them if
// r is the first. A missing directory is not an error: r is not watched
// then.
func (w *Watcher) watch(r *Reader) {
	if w.start() != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed || r.watched {
		return
	}
	dw := w.dirs[r.dir]
	if dw == nil {
		wd, err := w.in.Add(r.dir, dirMask)
		if err != nil {
			return
		}
		dw = &dirWatch{dir: r.dir, wd: wd, files: map[string]*fileWatch{}}
		w.dirs[r.dir] = dw
		w.byWD[wd] = dw
	}
	fw := dw.files[r.base]
	if fw == nil {
		fw = &fileWatch{dw: dw, base: r.base, wd: -1, subs: map[*Reader]struct{}{}}
		dw.files[r.base] = fw
		w.watchFile(fw)
	}
	fw.subs[r] = struct{}{}
	r.watched = true
}

// unwatch removes r, and the watches with their last reader.
func (w *Watcher) unwatch(r *Reader) {
	w.mu.Lock()
	defer w.mu.Unlock()
	dw := w.dirs[r.dir]
	if dw == nil || dw.files[r.base] == nil {
		return
	}
	fw := dw.files[r.base]
	delete(fw.subs, r)
	r.watched = false
	if len(fw.subs) > 0 {
		return
	}
	delete(dw.files, r.base)
	if fw.wd >= 0 {
		delete(w.byWD, fw.wd)
		if !w.closed {
			w.in.Remove(fw.wd)
		}
	}
	if len(dw.files) == 0 {
		delete(w.dirs, dw.dir)
		delete(w.byWD, dw.wd)
		if !w.closed {
			w.in.Remove(dw.wd)
		}
	}
}

// Reader reads one rotated log pair and follows it. It is not safe for
// concurrent use, except Changed, which any goroutine may wait on.
type Reader struct {
	w                   *Watcher
	path, prev          string
	dir, base, prevBase string
	changed             chan struct{}
	watched             bool // under w.mu

	// files are the generations opened, oldest first; sizes their sizes
	// when the pair was opened (ReadAt's view).
	files []*os.File
	sizes []int64
	i     int   // the generation Read reads
	off   int64 // Read's offset in files[i]
}

// Open opens the log at path (and its older generation path+".1") for
// reading from its start, and starts watching its directory before
// reading anything, so no change after Open goes unnoticed. A missing
// file is empty; a log that does not exist yet is read once it does. No
// link is followed: a VM's console log is in a directory its confined
// hypervisor owns, which could put one there.
func (w *Watcher) Open(path string) (*Reader, error) {
	r := &Reader{w: w, path: path, prev: path + ".1", dir: filepath.Dir(path), base: filepath.Base(path),
		prevBase: filepath.Base(path) + ".1", changed: make(chan struct{}, 1)}
	w.watch(r)
	for _, p := range []string{r.prev, r.path} {
		f, err := nofollow.Open(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			r.Close()
			return nil, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			r.Close()
			return nil, err
		}
		// The pair may have rotated between the two opens: the file now
		// at path.1 was path a moment ago. Keep one of each.
		if len(r.files) > 0 && sameFile(r.files[0], f) {
			f.Close()
			continue
		}
		r.files = append(r.files, f)
		r.sizes = append(r.sizes, st.Size())
	}
	return r, nil
}

// Size is the pair's size when it was opened.
func (r *Reader) Size() int64 {
	var n int64
	for _, s := range r.sizes {
		n += s
	}
	return n
}

// ReadAt reads the pair as it was opened (the two generations one after
// the other, each at its size then), without moving Read's position.
func (r *Reader) ReadAt(p []byte, off int64) (int, error) {
	total := 0
	for i, f := range r.files {
		if i >= len(r.sizes) {
			break
		}
		if off >= r.sizes[i] {
			off -= r.sizes[i]
			continue
		}
		want := p[total:]
		if rest := r.sizes[i] - off; int64(len(want)) > rest {
			want = want[:rest]
		}
		n, err := f.ReadAt(want, off)
		total += n
		if err != nil && err != io.EOF {
			return total, err
		}
		if total == len(p) {
			return total, nil
		}
		off = 0
	}
	return total, io.EOF
}

// SetPos sets where Read goes on: off in the pair as it was opened (beyond
// its end: its end).
func (r *Reader) SetPos(off int64) {
	r.i, r.off = 0, 0
	for i := range r.sizes {
		r.i = i
		if off <= r.sizes[i] || i == len(r.sizes)-1 {
			r.off = min(off, r.sizes[i])
			return
		}
		off -= r.sizes[i]
	}
}

// Read reads on from its position: the rest of the generation in hand,
// then the newer ones. It returns io.EOF when it has read everything
// written so far; a later Read returns what comes next.
func (r *Reader) Read(p []byte) (int, error) {
	for {
		if r.i < len(r.files) {
			n, err := r.files[r.i].ReadAt(p, r.off)
			if n > 0 {
				r.off += int64(n)
				return n, nil
			}
			if err != nil && err != io.EOF {
				return 0, err
			}
			if r.i < len(r.files)-1 {
				r.i, r.off = r.i+1, 0
				continue
			}
		}
		moved, err := r.advance()
		if err != nil {
			return 0, err
		}
		if !moved {
			return 0, io.EOF
		}
	}
}

// advance is called at the end of the newest generation in hand: it
// reports whether there is more to read, opening the generations written
// since.
func (r *Reader) advance() (bool, error) {
	cur, err := nofollow.Open(r.path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil // between a rotation's rename and its new file
	}
	if err != nil {
		return false, err
	}
	var last *os.File
	if len(r.files) > 0 {
		last = r.files[len(r.files)-1]
	}
	if last != nil && sameFile(cur, last) {
		cur.Close()
		return false, nil
	}
	if last != nil {
		// The file in hand was rotated away: it no longer changes, but a
		// write may have landed after the end Read saw.
		if st, err := last.Stat(); err == nil && r.i == len(r.files)-1 && st.Size() > r.off {
			cur.Close()
			return true, nil
		}
	}
	var next []*os.File
	if prev, err := nofollow.Open(r.prev); err == nil {
		// path.1 is the file in hand (one rotation), or a generation
		// after it (the writer rotated again before this reader got
		// here), or what path was when Open found nothing.
		if (last == nil || !sameFile(prev, last)) && !sameFile(prev, cur) {
			next = append(next, prev)
		} else {
			prev.Close()
		}
	}
	next = append(next, cur)
	for _, f := range r.files {
		f.Close()
	}
	r.files, r.sizes = next, nil
	r.i, r.off = 0, 0
	return true, nil
}

// Changed receives a value after the log's files changed (written,
// rotated, created, removed) since it was last received; it may fire with
// nothing new to read. It never fires for a reader whose directory could
// not be watched (see Rewatch).
func (r *Reader) Changed() <-chan struct{} { return r.changed }

// Rewatch watches the log's directory if Open could not (it did not exist
// yet) or it was removed since; it does nothing otherwise.
func (r *Reader) Rewatch() { r.w.watch(r) }

func (r *Reader) poke() {
	select {
	case r.changed <- struct{}{}:
	default:
	}
}

// Close closes the files and stops watching.
func (r *Reader) Close() error {
	r.w.unwatch(r)
	for _, f := range r.files {
		f.Close()
	}
	r.files = nil
	return nil
}

func sameFile(a, b *os.File) bool { return os.SameFile(statOf(a), statOf(b)) }

func statOf(f *os.File) os.FileInfo {
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	return st
}
