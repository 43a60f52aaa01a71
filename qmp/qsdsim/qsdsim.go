// Package qsdsim is a qemu-storage-daemon simulator: run as
// `vmhost sim-qsd` with QSD's own flags, it parses the same --blockdev,
// --object, --export, --chardev, --monitor and --pidfile arguments (dotted
// key=value or JSON), fails at startup the way QSD 7.2 does (a missing
// image, a raw file, an unknown node, an over-long socket path, a missing
// backing file), listens on each vhost-user-blk export socket and answers
// the QMP commands vmhost uses with QSD's shapes and error texts (see
// docs/ref/qcow2-overlays.md for the backing-file ones). It exits 0 on quit
// and on SIGTERM, removing its sockets and pidfile.
//
// Backing files as in QSD: a qcow2 node whose header names one opens it
// (and its own backing files, recursively) as extra read-only nodes named
// #block<N>, removed with the node, unless the options say "backing": null
// or name an existing node to use instead. A file node opens its file
// read-write unless "read-only" is set, so an immutable build fails the
// way it fails in QSD ("Operation not permitted").
//
// Limits: export sockets answer only the vhost-user queries a front-end
// makes before setting up rings (GET_FEATURES, GET_PROTOCOL_FEATURES,
// GET_QUEUE_NUM, GET_CONFIG with the capacity fixed at export time); no I/O
// is served, and throttle limits are stored, not enforced. block_resize
// rewrites the qcow2 header (size and L1 length) when the grown L1 table
// still fits in its clusters, which covers growth up to 4 TiB for images
// made by qemu-img; beyond that the new size is kept in memory only.
// blockdev-create writes a minimal qcow2 image (no header extensions).
// blockdev-reopen takes the options a node has and changes nothing.
// Only qcow2 backing files are followed (a backing format other than qcow2
// is refused), and a node's "file" is always its host file's name where
// QSD sometimes shows a json: description (a "backing": null over a header
// that names a backing file, or a backing node other than the header's).
// Images are not locked, so a second daemon on the same image is not
// refused as QSD refuses it ("Failed to get \"write\" lock").
//
// The package imports none of vmhost's packages.
package qsdsim

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// qerr is a QMP error reply.
type qerr struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *qerr) Error() string { return e.Desc }

func generic(format string, a ...any) *qerr {
	return &qerr{"GenericError", fmt.Sprintf(format, a...)}
}

type node struct {
	name     string
	drv      string // file, qcow2, throttle
	child    string // file child node
	backing  string // qcow2: the backing node, if any
	group    string // throttle group
	filename string // file: the host file; others: the file node's
	size     uint64 // virtual size
	users    int    // parents (by file or backing) and exports
	ro       bool
	// implicit: opened by QSD for a backing file its parent's header
	// names (#block<N>), so deleted with that parent.
	implicit bool
	// What a qcow2 header names as the backing file and its format.
	hdrBacking, hdrBackingFmt string
}

type export struct {
	id, node, path string
	ln             net.Listener
	conns          []net.Conn
	// What the front-end is told: fixed when the export is made, since a
	// 7.2 export never reports a later resize.
	capacity  uint64 // in 512-byte sectors
	writable  bool
	numQueues int
}

type job struct {
	ID              string `json:"id"`
	Type            string `json:"type"`
	Status          string `json:"status"`
	CurrentProgress int    `json:"current-progress"`
	TotalProgress   int    `json:"total-progress"`
	Error           string `json:"error,omitempty"`
}

// sim is the daemon's state; mu guards everything below it.
type sim struct {
	mu       sync.Mutex
	nodes    []*node // newest first, like query-named-block-nodes
	groups   map[string]map[string]int64
	exports  []*export // newest first, like query-block-exports
	jobs     []*job
	chardevs map[string]string // id → socket path
	monitors []net.Listener
	monPaths []string
	pidfile  string
	pidLock  *os.File
	// nextImplicit numbers the nodes opened for backing files.
	nextImplicit int

	quit chan struct{}
	once sync.Once
}

// Main runs the simulator with QSD's arguments (without the program name)
// and returns its exit status.
func Main(args []string) int {
	s := &sim{groups: map[string]map[string]int64{}, chardevs: map[string]string{}, quit: make(chan struct{})}
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	defer signal.Stop(sigs)
	if err := s.parseArgs(args); err != nil {
		fmt.Fprintln(os.Stderr, "qemu-storage-daemon: "+err.Error())
		s.cleanup()
		return 1
	}
	for _, ln := range s.monitors {
		go s.serveMonitor(ln)
	}
	select {
	case <-s.quit:
	case <-sigs:
	}
	s.cleanup()
	return 0
}

// parseArgs processes options left to right, as QSD does.
func (s *sim) parseArgs(args []string) error {
	for i := 0; i < len(args); i++ {
		opt, val, hasVal := strings.Cut(args[i], "=")
		if !strings.HasPrefix(opt, "--") {
			return fmt.Errorf("Unexpected argument: %s", args[i])
		}
		if !hasVal {
			if opt == "--daemonize" {
				return errors.New("--daemonize: not supported by the simulator")
			}
			if i+1 >= len(args) {
				return fmt.Errorf("option '%s' requires an argument", opt)
			}
			i++
			val = args[i]
		}
		var err error
		switch opt {
		case "--blockdev":
			var m map[string]any
			if m, err = parseOpts(val, ""); err == nil {
				err = s.blockdevAdd(m)
			}
		case "--object":
			var m map[string]any
			if m, err = parseOpts(val, "qom-type"); err == nil {
				err = s.objectAdd(m)
			}
		case "--export":
			var m map[string]any
			if m, err = parseOpts(val, "type"); err == nil {
				err = s.exportAdd(m)
			}
		case "--chardev":
			var m map[string]any
			if m, err = parseOpts(val, "backend"); err == nil {
				err = s.chardevAdd(m)
			}
		case "--monitor":
			var m map[string]any
			if m, err = parseOpts(val, "chardev"); err == nil {
				err = s.monitorAdd(m)
			}
		case "--pidfile":
			err = s.writePidfile(val)
		default:
			return fmt.Errorf("unrecognized option '%s'", opt)
		}
		if err != nil {
			return fmt.Errorf("%s %s: %w", opt, val, err)
		}
	}
	return nil
}

// parseOpts reads JSON ({...}) or QEMU's dotted key=value,key2=v2 syntax
// (",," escapes a comma). A leading element without "=" is the value of
// implied, e.g. the chardev backend.
func parseOpts(s, implied string) (map[string]any, error) {
	if strings.HasPrefix(strings.TrimSpace(s), "{") {
		var m map[string]any
		d := json.NewDecoder(strings.NewReader(s))
		d.UseNumber()
		if err := d.Decode(&m); err != nil {
			return nil, fmt.Errorf("JSON parse error, %v", err)
		}
		return m, nil
	}
	var parts []string
	var cur strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == ',' {
			if i+1 < len(s) && s[i+1] == ',' {
				cur.WriteByte(',')
				i++
				continue
			}
			parts = append(parts, cur.String())
			cur.Reset()
			continue
		}
		cur.WriteByte(s[i])
	}
	parts = append(parts, cur.String())
	m := map[string]any{}
	for i, p := range parts {
		k, v, ok := strings.Cut(p, "=")
		if !ok {
			if i == 0 && implied != "" {
				k, v = implied, p
			} else {
				return nil, fmt.Errorf("Invalid parameter '%s'", p)
			}
		}
		// Dotted keys nest: addr.type=unix → {"addr":{"type":"unix"}}.
		keys := strings.Split(k, ".")
		cm := m
		for _, sub := range keys[:len(keys)-1] {
			next, ok := cm[sub].(map[string]any)
			if !ok {
				next = map[string]any{}
				cm[sub] = next
			}
			cm = next
		}
		cm[keys[len(keys)-1]] = v
	}
	return m, nil
}

// str returns a string member, or "" when absent.
func str(m map[string]any, key string) (string, error) {
	v, ok := m[key]
	if !ok || v == nil {
		return "", nil
	}
	s, ok := v.(string)
	if !ok {
		return "", fmt.Errorf("Invalid parameter type for '%s', expected: string", key)
	}
	return s, nil
}

// boolean accepts JSON booleans and QEMU's on/off/true/false strings.
func boolean(m map[string]any, key string) (bool, error) {
	switch v := m[key].(type) {
	case nil:
		return false, nil
	case bool:
		return v, nil
	case string:
		switch v {
		case "on", "true", "yes":
			return true, nil
		case "off", "false", "no":
			return false, nil
		}
	}
	return false, fmt.Errorf("Invalid parameter type for '%s', expected: boolean", key)
}

// integer accepts JSON numbers (float64 or json.Number) and numeric
// strings. ok is false when the key is absent.
func integer(m map[string]any, key string) (n int64, ok bool, err error) {
	v, present := m[key]
	if !present {
		return 0, false, nil
	}
	bad := fmt.Errorf("Invalid parameter type for '%s', expected: integer", key)
	switch v := v.(type) {
	case float64:
		if v != float64(int64(v)) {
			return 0, true, bad
		}
		return int64(v), true, nil
	case json.Number:
		n, err := v.Int64()
		if err != nil {
			return 0, true, bad
		}
		return n, true, nil
	case string:
		n, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return 0, true, bad
		}
		return n, true, nil
	}
	return 0, true, bad
}

func (s *sim) findNode(name string) *node {
	for _, n := range s.nodes {
		if n.name == name {
			return n
		}
	}
	return nil
}

func (s *sim) findExport(id string) *export {
	for _, e := range s.exports {
		if e.id == id {
			return e
		}
	}
	return nil
}

// blockdevAdd opens a node; the caller holds mu or is still single-threaded.
func (s *sim) blockdevAdd(m map[string]any) error {
	drv, err := str(m, "driver")
	if err != nil {
		return err
	}
	name, err := str(m, "node-name")
	if err != nil {
		return err
	}
	if drv == "" {
		return errors.New("Parameter 'driver' is missing")
	}
	if name == "" {
		return errors.New("A block device must be given a name (node-name)")
	}
	if s.findNode(name) != nil {
		return fmt.Errorf("Duplicate nodes with node-name='%s'", name)
	}
	ro, err := boolean(m, "read-only")
	if err != nil {
		return err
	}
	n := &node{name: name, drv: drv, ro: ro}
	var backingNodes []*node // opened for the header's backing file
	switch drv {
	case "file":
		fn, err := str(m, "filename")
		if err != nil {
			return err
		}
		if fn == "" {
			return errors.New("Parameter 'filename' is missing")
		}
		size, err := openFile(fn, ro)
		if err != nil {
			return err
		}
		n.filename, n.size = fn, size
	case "qcow2":
		child, err := s.childNode(m, "file")
		if err != nil {
			return err
		}
		if !ro && child.ro {
			return errors.New("Block node is read-only")
		}
		h, err := readHeader(child.filename)
		if err != nil {
			return err
		}
		n.hdrBacking, n.hdrBackingFmt = h.backing, h.backingFmt
		var backing *node
		switch b, present := m["backing"]; {
		case present && b == nil:
		case present:
			ref, ok := b.(string)
			if !ok {
				return errors.New("the simulator takes a backing node by name only")
			}
			if backing = s.findNode(ref); backing == nil {
				return fmt.Errorf("Could not open backing file: Cannot find device='%s' nor node-name='%s'", ref, ref)
			}
		case h.backing != "":
			if backingNodes, err = s.openBacking(h.backing, h.backingFmt); err != nil {
				return fmt.Errorf("Could not open backing file: %w", err)
			}
			backing = backingNodes[0]
		}
		if backing != nil {
			n.backing = backing.name
			backing.users++
		}
		n.child, n.filename, n.size = child.name, child.filename, h.size
		child.users++
	case "throttle":
		group, err := str(m, "throttle-group")
		if err != nil {
			return err
		}
		if _, ok := s.groups[group]; !ok {
			return fmt.Errorf("Throttle group '%s' does not exist", group)
		}
		child, err := s.childNode(m, "file")
		if err != nil {
			return err
		}
		n.child, n.group, n.filename, n.size = child.name, group, child.filename, child.size
		child.users++
	default:
		return fmt.Errorf("Parameter 'driver' does not accept value '%s'", drv)
	}
	// QSD lists the backing file's nodes before the node that opened them.
	s.nodes = append(append(backingNodes, n), s.nodes...)
	return nil
}

// openFile opens fn as a file node does: read-write unless ro (so an
// immutable or read-only file is refused), and returns its size rounded
// up to a sector.
func openFile(fn string, ro bool) (uint64, error) {
	flag := os.O_RDWR
	if ro {
		flag = os.O_RDONLY
	}
	f, err := os.OpenFile(fn, flag, 0)
	if err != nil {
		return 0, fmt.Errorf("Could not open '%s': %s", fn, errnoText(err))
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, fmt.Errorf("Could not open '%s': %s", fn, errnoText(err))
	}
	return (uint64(st.Size()) + 511) / 512 * 512, nil
}

// openBacking opens the backing file a header names, read-only, as QSD
// does: a qcow2 node over a file node, both named #block<N>, and the same
// for the backing file's own backing file. It returns the nodes top first;
// the caller adds them. The errors nest as QSD's do ("Could not open
// backing file: " once per level).
func (s *sim) openBacking(path, format string) ([]*node, error) {
	if format != "" && format != "qcow2" {
		return nil, fmt.Errorf("the simulator follows qcow2 backing files only, not %s", format)
	}
	size, err := openFile(path, true)
	if err != nil {
		return nil, err
	}
	h, err := readHeader(path)
	if err != nil {
		return nil, err
	}
	file := &node{name: s.implicitName(), drv: "file", filename: path, size: size, ro: true, implicit: true, users: 1}
	q := &node{name: s.implicitName(), drv: "qcow2", child: file.name, filename: path, size: h.size, ro: true, implicit: true,
		hdrBacking: h.backing, hdrBackingFmt: h.backingFmt}
	nodes := []*node{q, file}
	if h.backing != "" {
		deeper, err := s.openBacking(h.backing, h.backingFmt)
		if err != nil {
			return nil, fmt.Errorf("Could not open backing file: %w", err)
		}
		q.backing = deeper[0].name
		deeper[0].users++
		nodes = append(nodes, deeper...)
	}
	return nodes, nil
}

func (s *sim) implicitName() string {
	s.nextImplicit++
	return fmt.Sprintf("#block%d", 100+s.nextImplicit)
}

// childNode resolves a reference to an existing node.
func (s *sim) childNode(m map[string]any, key string) (*node, error) {
	ref, err := str(m, key)
	if err != nil {
		return nil, errors.New("the simulator takes child nodes by name only")
	}
	if ref == "" {
		return nil, fmt.Errorf("Parameter '%s' is missing", key)
	}
	n := s.findNode(ref)
	if n == nil {
		return nil, fmt.Errorf("Cannot find device='%s' nor node-name='%s'", ref, ref)
	}
	return n, nil
}

// errnoText renders an error the way QEMU's strerror does.
func errnoText(err error) string {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		s := errno.Error()
		return strings.ToUpper(s[:1]) + s[1:]
	}
	return err.Error()
}

type header struct {
	version    uint32
	size       uint64
	backing    string
	backingFmt string // the backing-format extension, if any
	l1Size     uint32
	l1Offset   uint64
	cbits      uint32
}

func readHeader(path string) (*header, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("Could not open '%s': %s", path, errnoText(err))
	}
	defer f.Close()
	var b [72]byte
	if _, err := io.ReadFull(f, b[:]); err != nil || binary.BigEndian.Uint32(b[0:]) != 0x514649fb {
		return nil, errors.New("Image is not in qcow2 format")
	}
	be := binary.BigEndian
	h := &header{version: be.Uint32(b[4:]), size: be.Uint64(b[24:]), cbits: be.Uint32(b[20:]), l1Size: be.Uint32(b[36:]), l1Offset: be.Uint64(b[40:])}
	if h.version != 2 && h.version != 3 {
		return nil, fmt.Errorf("Unsupported qcow2 version %d", h.version)
	}
	if off, n := be.Uint64(b[8:]), be.Uint32(b[16:]); off != 0 && n > 0 && n < 1024 {
		name := make([]byte, n)
		if _, err := f.ReadAt(name, int64(off)); err == nil {
			h.backing = string(name)
		}
		h.backingFmt = backingFormat(f, h, off)
	}
	return h, nil
}

// backingFormat walks the header extensions (after the 104-byte v3
// header's header_length, or the 72-byte v2 header) up to the end marker,
// the backing file name at backingOff or the end of cluster 0, and returns
// the backing-format extension's text.
func backingFormat(f *os.File, h *header, backingOff uint64) string {
	be := binary.BigEndian
	off := uint64(72)
	if h.version == 3 {
		var b [4]byte
		if _, err := f.ReadAt(b[:], 100); err != nil {
			return ""
		}
		off = uint64(be.Uint32(b[:]))
	}
	end := backingOff
	if h.cbits >= 9 && h.cbits <= 21 {
		end = min(end, uint64(1)<<h.cbits)
	}
	var ext [8]byte
	for off+8 <= end {
		if _, err := f.ReadAt(ext[:], int64(off)); err != nil {
			return ""
		}
		typ, n := be.Uint32(ext[0:]), uint64(be.Uint32(ext[4:]))
		switch {
		case typ == 0:
			return ""
		case typ == 0xe2792aca && n < 1024:
			name := make([]byte, n)
			if _, err := f.ReadAt(name, int64(off+8)); err != nil {
				return ""
			}
			return string(name)
		}
		off += 8 + (n+7)/8*8
	}
	return ""
}

// throttleKeys are the 19 keys of a throttle group's limits.
var throttleKeys = []string{
	"bps-total", "bps-total-max", "bps-total-max-length",
	"bps-read", "bps-read-max", "bps-read-max-length",
	"bps-write", "bps-write-max", "bps-write-max-length",
	"iops-total", "iops-total-max", "iops-total-max-length",
	"iops-read", "iops-read-max", "iops-read-max-length",
	"iops-write", "iops-write-max", "iops-write-max-length",
	"iops-size",
}

func defaultLimits() map[string]int64 {
	l := map[string]int64{}
	for _, k := range throttleKeys {
		l[k] = 0
		if strings.HasSuffix(k, "-max-length") {
			l[k] = 1
		}
	}
	return l
}

// mergeLimits applies the keys in v over cur (keys left out keep their
// values, as in QEMU) and validates the result as throttle_is_valid does.
func mergeLimits(cur map[string]int64, v map[string]any) (map[string]int64, error) {
	next := map[string]int64{}
	for k, x := range cur {
		next[k] = x
	}
	for k := range v {
		if _, ok := next[k]; !ok {
			return nil, fmt.Errorf("Parameter 'limits.%s' is unexpected", k)
		}
		n, _, err := integer(v, k)
		if err != nil {
			return nil, err
		}
		next[k] = n
	}
	for _, k := range throttleKeys {
		if next[k] < 0 || next[k] > 1e15 {
			return nil, errors.New("bps/iops/max values must be within [0, 1000000000000000]")
		}
	}
	for _, kind := range []string{"bps", "iops"} {
		total := next[kind+"-total"] != 0 || next[kind+"-total-max"] != 0
		rw := next[kind+"-read"] != 0 || next[kind+"-write"] != 0 || next[kind+"-read-max"] != 0 || next[kind+"-write-max"] != 0
		if total && rw {
			return nil, errors.New("bps/iops/max total values and read/write values cannot be used at the same time")
		}
	}
	for _, k := range []string{"bps-total", "bps-read", "bps-write", "iops-total", "iops-read", "iops-write"} {
		avg, mx, length := next[k], next[k+"-max"], next[k+"-max-length"]
		if mx != 0 && avg == 0 {
			return nil, errors.New("bps_max/iops_max require corresponding bps/iops values")
		}
		if mx != 0 && mx < avg {
			return nil, errors.New("bps_max/iops_max cannot be lower than bps/iops")
		}
		if length < 1 {
			return nil, errors.New("the burst length cannot be 0")
		}
		if length > 1 && mx == 0 {
			return nil, errors.New("burst length set without burst rate")
		}
	}
	return next, nil
}

func (s *sim) objectAdd(m map[string]any) error {
	typ, _ := str(m, "qom-type")
	id, _ := str(m, "id")
	if typ != "throttle-group" {
		return fmt.Errorf("invalid object type: %s", typ)
	}
	if id == "" {
		return errors.New("Parameter 'id' is missing")
	}
	if _, ok := s.groups[id]; ok {
		return fmt.Errorf("attempt to add duplicate property '%s' to object (type 'container')", id)
	}
	set := map[string]any{}
	if lm, ok := m["limits"].(map[string]any); ok {
		for k, v := range lm {
			set[k] = v
		}
	}
	for k, v := range m {
		if rest, ok := strings.CutPrefix(k, "x-"); ok {
			set[rest] = v
		}
	}
	l, err := mergeLimits(defaultLimits(), set)
	if err != nil {
		return err
	}
	s.groups[id] = l
	return nil
}

// listenUnix binds a socket at path the way QSD does: whatever is there
// (even a regular file) is unlinked first.
func listenUnix(path string) (net.Listener, error) {
	if len(path) >= 108 {
		return nil, fmt.Errorf("UNIX socket path '%s' is too long", path)
	}
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("Failed to bind socket to %s: %s", path, errnoText(err))
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(true)
	return ln, nil
}

func (s *sim) exportAdd(m map[string]any) error {
	typ, _ := str(m, "type")
	id, _ := str(m, "id")
	nodeName, _ := str(m, "node-name")
	if typ != "vhost-user-blk" {
		return fmt.Errorf("Parameter 'type' does not accept value '%s'", typ)
	}
	if id == "" {
		return errors.New("Parameter 'id' is missing")
	}
	if s.findExport(id) != nil {
		return fmt.Errorf("Block export id '%s' is already in use", id)
	}
	n := s.findNode(nodeName)
	if n == nil {
		return fmt.Errorf("Cannot find device='' nor node-name='%s'", nodeName)
	}
	addr, _ := m["addr"].(map[string]any)
	if addr == nil {
		return errors.New("Parameter 'addr' is missing")
	}
	if t, _ := str(addr, "type"); t != "unix" {
		return errors.New("the simulator only exports on unix sockets")
	}
	path, _ := str(addr, "path")
	writable, err := boolean(m, "writable")
	if err != nil {
		return err
	}
	numQueues, ok, err := integer(m, "num-queues")
	if err != nil {
		return err
	}
	if !ok {
		numQueues = 1
	}
	ln, err := listenUnix(path)
	if err != nil {
		return err
	}
	e := &export{id: id, node: nodeName, path: path, ln: ln, capacity: n.size / 512, writable: writable, numQueues: int(numQueues)}
	n.users++
	s.exports = append([]*export{e}, s.exports...)
	go s.serveExport(e)
	return nil
}

// serveExport accepts front-ends and holds their connections until the
// export goes away.
func (s *sim) serveExport(e *export) {
	for {
		c, err := e.ln.Accept()
		if err != nil {
			return
		}
		s.mu.Lock()
		e.conns = append(e.conns, c)
		s.mu.Unlock()
		go e.serveVhostUser(c)
	}
}

// vhost-user requests the simulator answers; it ignores the rest.
const (
	vhostGetFeatures         = 1
	vhostGetProtocolFeatures = 15
	vhostGetQueueNum         = 17
	vhostGetConfig           = 24
	vhostFlagVersion         = 0x1
	vhostFlagReply           = 0x4
	// The feature bits QSD 7.2 offered for a writable export (ref §10);
	// bit 5 (VIRTIO_BLK_F_RO) is added for a read-only one.
	vhostFeatures         = 0x175007e46
	vhostProtocolFeatures = 0x0000000000000a07 // MQ, REPLY_ACK, CONFIG, ...
)

// serveVhostUser answers the vhost-user queries a front-end makes before
// it sets up rings: features, queue count and the virtio-blk config (the
// capacity and num_queues); it serves no I/O.
func (e *export) serveVhostUser(c net.Conn) {
	le := binary.LittleEndian
	var hdr [12]byte
	for {
		if _, err := io.ReadFull(c, hdr[:]); err != nil {
			return
		}
		req, size := le.Uint32(hdr[0:]), le.Uint32(hdr[8:])
		if size > 4096 {
			return
		}
		payload := make([]byte, size)
		if _, err := io.ReadFull(c, payload); err != nil {
			return
		}
		var body []byte
		switch req {
		case vhostGetFeatures:
			f := uint64(vhostFeatures)
			if !e.writable {
				f |= 1 << 5
			}
			body = le.AppendUint64(nil, f)
		case vhostGetProtocolFeatures:
			body = le.AppendUint64(nil, vhostProtocolFeatures)
		case vhostGetQueueNum:
			body = le.AppendUint64(nil, uint64(e.numQueues))
		case vhostGetConfig:
			if len(payload) < 12 {
				return
			}
			off, n := le.Uint32(payload[0:]), le.Uint32(payload[4:])
			cfg := make([]byte, 60)
			le.PutUint64(cfg[0:], e.capacity)
			le.PutUint32(cfg[12:], 128) // seg_max
			le.PutUint32(cfg[20:], 512) // blk_size
			le.PutUint16(cfg[34:], uint16(e.numQueues))
			body = append([]byte(nil), payload[:12]...)
			for i := range n {
				var b byte
				if int(off+i) < len(cfg) {
					b = cfg[off+i]
				}
				body = append(body, b)
			}
		default:
			continue
		}
		out := make([]byte, 12, 12+len(body))
		le.PutUint32(out[0:], req)
		le.PutUint32(out[4:], vhostFlagVersion|vhostFlagReply)
		le.PutUint32(out[8:], uint32(len(body)))
		if _, err := c.Write(append(out, body...)); err != nil {
			return
		}
	}
}

func (e *export) close() {
	e.ln.Close()
	for _, c := range e.conns {
		c.Close()
	}
}

func (s *sim) chardevAdd(m map[string]any) error {
	backend, _ := str(m, "backend")
	id, _ := str(m, "id")
	path, _ := str(m, "path")
	if backend != "socket" || path == "" {
		return errors.New("the simulator supports only socket chardevs with a path")
	}
	if server, err := boolean(m, "server"); err != nil || !server {
		return errors.New("the simulator supports only server=on")
	}
	if wait, err := boolean(m, "wait"); err != nil || wait {
		return errors.New("the simulator supports only wait=off")
	}
	s.chardevs[id] = path
	return nil
}

func (s *sim) monitorAdd(m map[string]any) error {
	id, _ := str(m, "chardev")
	path, ok := s.chardevs[id]
	if !ok {
		return fmt.Errorf("chardev \"%s\" not found", id)
	}
	ln, err := listenUnix(path)
	if err != nil {
		return err
	}
	s.monitors = append(s.monitors, ln)
	s.monPaths = append(s.monPaths, path)
	return nil
}

// writePidfile writes and locks the pidfile, as QSD does after its
// sockets exist.
func (s *sim) writePidfile(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return fmt.Errorf("cannot create PID file: Cannot open pid file: %s", errnoText(err))
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		return fmt.Errorf("cannot create PID file: Cannot lock pid file: %s", errnoText(err))
	}
	if err := f.Truncate(0); err == nil {
		_, err = f.WriteString(strconv.Itoa(os.Getpid()) + "\n")
	}
	if err != nil {
		f.Close()
		return fmt.Errorf("cannot create PID file: Failed to write pid file: %s", errnoText(err))
	}
	s.pidfile, s.pidLock = path, f
	return nil
}

// cleanup closes every socket (unlinking it) and removes the pidfile.
func (s *sim) cleanup() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range s.exports {
		e.close()
	}
	s.exports = nil
	for _, ln := range s.monitors {
		ln.Close()
	}
	if s.pidLock != nil {
		os.Remove(s.pidfile)
		s.pidLock.Close()
	}
}

// serveMonitor serves one QMP client at a time, like a QSD monitor.
func (s *sim) serveMonitor(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		s.serveConn(c)
		c.Close()
	}
}

// conn is one QMP session.
type conn struct {
	s       *sim
	c       net.Conn
	wmu     sync.Mutex
	capsSet bool
}

func (c *conn) send(v any) {
	b, err := json.Marshal(v)
	if err != nil {
		return
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	c.c.Write(append(b, '\r', '\n'))
}

// event sends an event with QEMU's timestamp shape.
func (c *conn) event(name string, data any) {
	now := time.Now()
	c.send(map[string]any{
		"timestamp": map[string]int64{"seconds": now.Unix(), "microseconds": int64(now.Nanosecond() / 1000)},
		"event":     name,
		"data":      data,
	})
}

func (s *sim) serveConn(nc net.Conn) {
	c := &conn{s: s, c: nc}
	c.send(map[string]any{"QMP": map[string]any{
		"version":      map[string]any{"qemu": map[string]int{"micro": 22, "minor": 2, "major": 7}, "package": "vmhost qsdsim"},
		"capabilities": []string{"oob"},
	}})
	r := bufio.NewReader(nc)
	for {
		line, err := r.ReadBytes('\n')
		if len(bytes.TrimSpace(line)) > 0 {
			// Several commands may share a line.
			d := json.NewDecoder(bytes.NewReader(line))
			d.UseNumber()
			for {
				var raw any
				if derr := d.Decode(&raw); derr != nil {
					if !errors.Is(derr, io.EOF) {
						c.send(map[string]any{"error": generic("JSON parse error, %v", derr)})
					}
					break
				}
				if stop := c.handle(raw); stop {
					return
				}
			}
		}
		if err != nil {
			return
		}
	}
}

// handle runs one request and reports whether the session is over (quit).
func (c *conn) handle(raw any) (stop bool) {
	req, ok := raw.(map[string]any)
	if !ok {
		c.send(map[string]any{"error": generic("QMP input must be a JSON object")})
		return false
	}
	id, hasID := req["id"]
	reply := func(ret any, err *qerr) {
		m := map[string]any{}
		if err != nil {
			m["error"] = err
		} else {
			m["return"] = ret
		}
		if hasID {
			m["id"] = id
		}
		c.send(m)
	}
	for k := range req {
		if k != "execute" && k != "arguments" && k != "id" && k != "exec-oob" {
			reply(nil, generic("QMP input member '%s' is unexpected", k))
			return false
		}
	}
	cmd, ok := req["execute"].(string)
	if !ok {
		reply(nil, generic("QMP input lacks member 'execute'"))
		return false
	}
	args, _ := req["arguments"].(map[string]any)
	if args == nil {
		args = map[string]any{}
	}
	if !c.capsSet {
		if cmd != "qmp_capabilities" {
			reply(nil, &qerr{"CommandNotFound", "Expecting capabilities negotiation with 'qmp_capabilities'"})
			return false
		}
		c.capsSet = true
		reply(map[string]any{}, nil)
		return false
	}
	h, ok := commands[cmd]
	if !ok {
		if cmd == "qmp_capabilities" {
			reply(nil, &qerr{"CommandNotFound", "Capabilities negotiation is already complete, command ignored"})
		} else {
			reply(nil, &qerr{"CommandNotFound", fmt.Sprintf("The command %s has not been found", cmd)})
		}
		return false
	}
	if err := checkArgs(args, h.allowed, h.required); err != nil {
		reply(nil, err)
		return false
	}
	if cmd == "quit" {
		c.s.shutdown(c)
		reply(map[string]any{}, nil)
		c.s.once.Do(func() { close(c.s.quit) })
		return true
	}
	c.s.mu.Lock()
	ret, err := h.run(c, args)
	c.s.mu.Unlock()
	if ret == nil && err == nil {
		ret = map[string]any{}
	}
	reply(ret, err)
	if h.after != nil && err == nil {
		h.after(c, args)
	}
	return false
}

func checkArgs(args map[string]any, allowed, required []string) *qerr {
	keys := make([]string, 0, len(args))
	for k := range args {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		found := false
		for _, a := range allowed {
			found = found || a == k
		}
		if !found && allowed != nil {
			return generic("Parameter '%s' is unexpected", k)
		}
	}
	for _, k := range required {
		if _, ok := args[k]; !ok {
			return generic("Parameter '%s' is missing", k)
		}
	}
	return nil
}

// shutdown emits what QSD emits on quit: one BLOCK_EXPORT_DELETED per
// export and a JOB_STATUS_CHANGE null per job.
func (s *sim) shutdown(c *conn) {
	s.mu.Lock()
	exports, jobs := s.exports, s.jobs
	s.exports, s.jobs = nil, nil
	for _, e := range exports {
		e.close()
	}
	s.mu.Unlock()
	for _, e := range exports {
		c.event("BLOCK_EXPORT_DELETED", map[string]string{"id": e.id})
	}
	for _, j := range jobs {
		c.event("JOB_STATUS_CHANGE", map[string]string{"status": "null", "id": j.ID})
	}
}

type command struct {
	allowed, required []string // nil allowed means anything goes
	run               func(c *conn, args map[string]any) (any, *qerr)
	// after runs once the return has been sent, for events that follow it.
	after func(c *conn, args map[string]any)
}

var commands map[string]command

func init() {
	commands = map[string]command{
		"query-version": {allowed: []string{}, run: func(*conn, map[string]any) (any, *qerr) {
			return map[string]any{"qemu": map[string]int{"micro": 22, "minor": 2, "major": 7}, "package": "vmhost qsdsim"}, nil
		}},
		"quit":                    {allowed: []string{}},
		"query-block-exports":     {allowed: []string{}, run: queryBlockExports},
		"query-named-block-nodes": {allowed: []string{"flat"}, run: queryNamedBlockNodes},
		"blockdev-add":            {required: []string{"driver"}, run: blockdevAddCmd},
		"blockdev-del":            {allowed: []string{"node-name"}, required: []string{"node-name"}, run: blockdevDel},
		"block-export-add":        {required: []string{"type", "id", "node-name"}, run: blockExportAdd},
		"block-export-del":        {allowed: []string{"id", "mode"}, required: []string{"id"}, run: blockExportDel},
		"block_resize":            {allowed: []string{"device", "node-name", "size"}, required: []string{"size"}, run: blockResize},
		"qom-set":                 {allowed: []string{"path", "property", "value"}, required: []string{"path", "property", "value"}, run: qomSet},
		"qom-get":                 {allowed: []string{"path", "property"}, required: []string{"path", "property"}, run: qomGet},
		"query-jobs":              {allowed: []string{}, run: queryJobs},
		"job-dismiss":             {allowed: []string{"id"}, required: []string{"id"}, run: jobDismiss},
		"blockdev-create":         {allowed: []string{"job-id", "options"}, required: []string{"job-id", "options"}, run: blockdevCreate, after: finishCreate},
		"blockdev-reopen":         {allowed: []string{"options"}, required: []string{"options"}, run: blockdevReopen},
	}
}

func queryBlockExports(c *conn, _ map[string]any) (any, *qerr) {
	out := []map[string]any{}
	for _, e := range c.s.exports {
		out = append(out, map[string]any{"node-name": e.node, "shutting-down": false, "type": "vhost-user-blk", "id": e.id})
	}
	return out, nil
}

func queryNamedBlockNodes(c *conn, _ map[string]any) (any, *qerr) {
	out := []map[string]any{}
	for _, n := range c.s.nodes {
		img := map[string]any{"virtual-size": n.size, "filename": n.filename, "format": n.drv, "dirty-flag": false}
		if n.drv != "file" {
			img["cluster-size"] = 65536
		}
		if n.hdrBacking != "" {
			img["backing-filename"], img["full-backing-filename"] = n.hdrBacking, n.hdrBacking
			if n.hdrBackingFmt != "" {
				img["backing-filename-format"] = n.hdrBackingFmt
			}
		}
		if n.drv == "qcow2" {
			img["format-specific"] = map[string]any{"type": "qcow2", "data": map[string]any{"compat": "1.1", "corrupt": false, "refcount-bits": 16}}
		}
		if st, err := os.Stat(n.filename); err == nil {
			img["actual-size"] = st.Sys().(*syscall.Stat_t).Blocks * 512
		}
		entry := map[string]any{
			"node-name": n.name, "drv": n.drv, "ro": n.ro, "file": n.filename, "image": img,
			"cache": map[string]bool{"no-flush": false, "direct": false, "writeback": true},
			"bps":   0, "iops": 0, "backing_file_depth": 0,
		}
		if b := c.s.findNode(n.backing); b != nil {
			entry["backing_file"] = b.filename
		}
		out = append(out, entry)
	}
	return out, nil
}

func blockdevAddCmd(c *conn, args map[string]any) (any, *qerr) {
	if err := c.s.blockdevAdd(args); err != nil {
		return nil, generic("%s", err)
	}
	return nil, nil
}

// blockdevReopen is blockdev-reopen with every node's options as they are:
// QSD flushes the nodes (the simulator holds nothing back) and changes
// nothing. An option that differs from the node's is refused, as QSD
// refuses the options a driver cannot change.
func blockdevReopen(c *conn, args map[string]any) (any, *qerr) {
	list, ok := args["options"].([]any)
	if !ok {
		return nil, &qerr{"GenericError", "Invalid parameter type for 'options', expected: array"}
	}
	for _, o := range list {
		m, ok := o.(map[string]any)
		if !ok {
			return nil, &qerr{"GenericError", "Invalid parameter type for 'options', expected: object"}
		}
		name, _ := str(m, "node-name")
		if name == "" {
			return nil, generic("node-name not specified")
		}
		n := c.s.findNode(name)
		if n == nil {
			return nil, generic("Cannot find device='' nor node-name='%s'", name)
		}
		if err := c.s.sameOptions(n, m); err != nil {
			return nil, generic("%s", err)
		}
	}
	return nil, nil
}

// sameOptions reports the first option of m that differs from node n's.
func (s *sim) sameOptions(n *node, m map[string]any) error {
	drv, _ := str(m, "driver")
	if drv != n.drv {
		return fmt.Errorf("Cannot change the option 'driver'")
	}
	ro, _ := boolean(m, "read-only")
	if ro != n.ro {
		return fmt.Errorf("Cannot change the option 'read-only'")
	}
	switch n.drv {
	case "qcow2", "throttle":
		if f, _ := str(m, "file"); f != n.child {
			return fmt.Errorf("Cannot change the option 'file'")
		}
	case "file":
		if f, _ := str(m, "filename"); f != n.filename {
			return fmt.Errorf("Cannot change the option 'filename'")
		}
	}
	if n.drv == "throttle" {
		if g, _ := str(m, "throttle-group"); g != n.group {
			return fmt.Errorf("Cannot change the option 'throttle-group'")
		}
	}
	if n.drv == "qcow2" {
		b, present := m["backing"]
		switch ref, _ := b.(string); {
		case !present && n.backing != "" && !n.implicit:
			return fmt.Errorf("backing is missing for '%s'", n.name)
		case present && b == nil && n.backing != "":
			return fmt.Errorf("Cannot change the option 'backing'")
		case ref != "" && ref != n.backing:
			return fmt.Errorf("Cannot change the option 'backing'")
		}
	}
	return nil
}

func blockdevDel(c *conn, args map[string]any) (any, *qerr) {
	name, _ := str(args, "node-name")
	s := c.s
	n := s.findNode(name)
	if n == nil {
		return nil, generic("Failed to find node with node-name='%s'", name)
	}
	for _, p := range s.nodes {
		if p.backing == name {
			return nil, generic("Node '%s' is busy: node is used as backing hd of '%s'", name, p.name)
		}
	}
	if n.implicit {
		return nil, generic("Node %s is not owned by the monitor", name)
	}
	if n.users > 0 {
		return nil, generic("Block device %s is in use", name)
	}
	s.removeNode(n)
	return nil, nil
}

// removeNode removes n, releases its file child and backing node, and
// removes those QSD opened on its own for n's backing file.
func (s *sim) removeNode(n *node) {
	for i, x := range s.nodes {
		if x == n {
			s.nodes = append(s.nodes[:i:i], s.nodes[i+1:]...)
			break
		}
	}
	for _, ref := range []string{n.child, n.backing} {
		if r := s.findNode(ref); r != nil {
			if r.users--; r.implicit && r.users == 0 {
				s.removeNode(r)
			}
		}
	}
}

func blockExportAdd(c *conn, args map[string]any) (any, *qerr) {
	if err := c.s.exportAdd(args); err != nil {
		return nil, generic("%s", err)
	}
	return nil, nil
}

func blockExportDel(c *conn, args map[string]any) (any, *qerr) {
	id, _ := str(args, "id")
	s := c.s
	for i, e := range s.exports {
		if e.id != id {
			continue
		}
		e.close()
		if n := s.findNode(e.node); n != nil {
			n.users--
		}
		s.exports = append(s.exports[:i:i], s.exports[i+1:]...)
		// QSD sends the event before the return.
		c.event("BLOCK_EXPORT_DELETED", map[string]string{"id": id})
		return nil, nil
	}
	return nil, generic("Export '%s' is not found", id)
}

func blockResize(c *conn, args map[string]any) (any, *qerr) {
	size, _, err := integer(args, "size")
	if err != nil {
		return nil, generic("%s", err)
	}
	if size <= 0 {
		return nil, generic("Parameter 'size' expects a >0 size")
	}
	name, _ := str(args, "node-name")
	dev, _ := str(args, "device")
	n := c.s.findNode(name)
	if n == nil || name == "" {
		return nil, generic("Cannot find device='%s' nor node-name='%s'", dev, name)
	}
	if size%512 != 0 {
		return nil, generic("The new size must be a multiple of 512")
	}
	if n.drv == "file" && n.users > 0 {
		return nil, generic("Permission conflict on node '%s': permissions 'resize' are both required by a parent and unshared by it", name)
	}
	// The node and those below it down to the image take the new size; a
	// filter above keeps its old cached size, as in QEMU.
	for cur := n; cur != nil && cur.drv != "file"; cur = c.s.findNode(cur.child) {
		cur.size = uint64(size)
		if cur.drv == "qcow2" {
			persistSize(cur.filename, uint64(size))
		}
	}
	return nil, nil
}

// persistSize writes a new virtual size into a qcow2 header when the L1
// table, grown, still fits in the clusters it occupies; new L1 entries are
// zeroed first, then size and l1_size are written in one sector.
func persistSize(path string, size uint64) {
	h, err := readHeader(path)
	if err != nil || h.cbits < 9 || h.cbits > 21 || h.l1Offset == 0 {
		return
	}
	cs := uint64(1) << h.cbits
	perL1 := cs * cs / 8
	newL1 := (size + perL1 - 1) / perL1
	oldBytes := uint64(h.l1Size) * 8
	if room := (oldBytes + cs - 1) / cs * cs; newL1*8 > room {
		return
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer f.Close()
	if newL1 > uint64(h.l1Size) {
		if _, err := f.WriteAt(make([]byte, newL1*8-oldBytes), int64(h.l1Offset+oldBytes)); err != nil {
			return
		}
		if f.Sync() != nil {
			return
		}
	} else {
		newL1 = uint64(h.l1Size)
	}
	var b [16]byte
	binary.BigEndian.PutUint64(b[0:], size)
	binary.BigEndian.PutUint32(b[12:], uint32(newL1))
	// Bytes 24..39: size, crypt_method (kept 0), l1_size.
	if _, err := f.WriteAt(b[:], 24); err == nil {
		f.Sync()
	}
}

// resolveGroup maps a QOM path to a throttle group id.
func (s *sim) resolveGroup(path string) (string, *qerr) {
	id := strings.TrimPrefix(path, "/objects/")
	if _, ok := s.groups[id]; !ok || strings.Contains(id, "/") {
		return "", &qerr{"DeviceNotFound", fmt.Sprintf("Device '%s' not found", path)}
	}
	return id, nil
}

func qomSet(c *conn, args map[string]any) (any, *qerr) {
	path, _ := str(args, "path")
	prop, _ := str(args, "property")
	id, qe := c.s.resolveGroup(path)
	if qe != nil {
		return nil, qe
	}
	switch {
	case prop == "limits":
		v, ok := args["value"].(map[string]any)
		if !ok {
			return nil, generic("Invalid parameter type for 'limits', expected: object")
		}
		next, err := mergeLimits(c.s.groups[id], v)
		if err != nil {
			return nil, generic("%s", err)
		}
		c.s.groups[id] = next
		return nil, nil
	case strings.HasPrefix(prop, "x-"):
		return nil, generic("Property cannot be set after initialization")
	}
	return nil, generic("Property 'throttle-group.%s' not found", prop)
}

func qomGet(c *conn, args map[string]any) (any, *qerr) {
	path, _ := str(args, "path")
	prop, _ := str(args, "property")
	id, qe := c.s.resolveGroup(path)
	if qe != nil {
		return nil, qe
	}
	l := c.s.groups[id]
	if prop == "limits" {
		return l, nil
	}
	if v, ok := l[strings.TrimPrefix(prop, "x-")]; ok && strings.HasPrefix(prop, "x-") {
		return v, nil
	}
	return nil, generic("Property 'throttle-group.%s' not found", prop)
}

func queryJobs(c *conn, _ map[string]any) (any, *qerr) {
	out := []*job{}
	out = append(out, c.s.jobs...)
	return out, nil
}

func jobDismiss(c *conn, args map[string]any) (any, *qerr) {
	id, _ := str(args, "id")
	for i, j := range c.s.jobs {
		if j.ID != id {
			continue
		}
		if j.Status != "concluded" {
			return nil, generic("Job '%s' in state '%s' cannot accept command verb 'dismiss'", id, j.Status)
		}
		c.s.jobs = append(c.s.jobs[:i:i], c.s.jobs[i+1:]...)
		c.event("JOB_STATUS_CHANGE", map[string]string{"status": "null", "id": id})
		return nil, nil
	}
	return nil, generic("Job not found")
}

// blockdevCreate runs the job synchronously; the events of a successful
// job straddle the return, those of a failed one precede it, as in QSD.
func blockdevCreate(c *conn, args map[string]any) (any, *qerr) {
	id, _ := str(args, "job-id")
	for _, j := range c.s.jobs {
		if j.ID == id {
			return nil, generic("Job ID '%s' already in use", id)
		}
	}
	opts, ok := args["options"].(map[string]any)
	if !ok {
		return nil, generic("Invalid parameter type for 'options', expected: object")
	}
	j := &job{ID: id, Type: "create", Status: "created", TotalProgress: 1}
	c.s.jobs = append(c.s.jobs, j)
	status := func(st string) {
		j.Status = st
		c.event("JOB_STATUS_CHANGE", map[string]string{"status": st, "id": id})
	}
	status("created")
	status("running")
	j.CurrentProgress = 1
	if err := c.s.create(opts); err != nil {
		j.Error = err.Error()
		status("aborting")
		status("concluded")
	}
	return nil, nil
}

// finishCreate sends the events that follow a successful job's return.
func finishCreate(c *conn, args map[string]any) {
	id, _ := str(args, "job-id")
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	for _, j := range c.s.jobs {
		if j.ID == id && j.Status == "running" {
			for _, st := range []string{"waiting", "pending", "concluded"} {
				j.Status = st
				c.event("JOB_STATUS_CHANGE", map[string]string{"status": st, "id": id})
			}
		}
	}
}

// create does the work of a blockdev-create job.
func (s *sim) create(opts map[string]any) error {
	drv, _ := str(opts, "driver")
	size, ok, err := integer(opts, "size")
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("Parameter 'size' is missing")
	}
	switch drv {
	case "file":
		fn, _ := str(opts, "filename")
		f, err := os.OpenFile(fn, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o644)
		if err != nil {
			return fmt.Errorf("Could not create '%s': %s", fn, errnoText(err))
		}
		defer f.Close()
		return f.Truncate(size)
	case "qcow2":
		ref, _ := str(opts, "file")
		n := s.findNode(ref)
		if n == nil || n.drv != "file" {
			return fmt.Errorf("Cannot find device='%s' nor node-name='%s'", ref, ref)
		}
		if size < 0 || size%512 != 0 {
			return errors.New("Image size must be a multiple of 512 bytes")
		}
		return writeBlankQcow2(n.filename, uint64(size))
	}
	return fmt.Errorf("Driver '%s' does not support image creation", drv)
}

// writeBlankQcow2 writes the smallest valid qcow2 v3 image: a 104-byte
// header with no extensions, refcount table, one refcount block and the
// L1 table, 64 KiB clusters.
func writeBlankQcow2(path string, size uint64) error {
	const cs = 1 << 16
	l1 := (size + cs*cs/8 - 1) / (cs * cs / 8)
	if l1*8 > 1<<25 {
		return errors.New("Image size is too large")
	}
	l1Clusters := (l1*8 + cs - 1) / cs
	b := make([]byte, 3*cs)
	be := binary.BigEndian
	be.PutUint32(b[0:], 0x514649fb)
	be.PutUint32(b[4:], 3)
	be.PutUint32(b[20:], 16)
	be.PutUint64(b[24:], size)
	be.PutUint32(b[36:], uint32(l1))
	if l1 > 0 {
		be.PutUint64(b[40:], 3*cs)
	}
	be.PutUint64(b[48:], cs)
	be.PutUint32(b[56:], 1)
	be.PutUint32(b[96:], 4)
	be.PutUint32(b[100:], 104)
	be.PutUint64(b[cs:], 2*cs)
	for i := range 3 + l1Clusters {
		be.PutUint16(b[2*cs+2*i:], 1)
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_TRUNC, 0)
	if err != nil {
		return fmt.Errorf("Could not open '%s': %s", path, errnoText(err))
	}
	defer f.Close()
	if _, err := f.Write(b); err != nil {
		return err
	}
	if err := f.Truncate(int64(3*cs + l1*8)); err != nil {
		return err
	}
	return f.Sync()
}
