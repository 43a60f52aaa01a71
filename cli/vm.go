package cli

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// vmView holds the fields of a VM view (docs/api.md) the tables show.
type vmView struct {
	ID           string     `json:"id"`
	Mode         string     `json:"mode"`
	State        string     `json:"state"`
	DisplayState string     `json:"display_state"`
	VCPUs        int        `json:"vcpus"`
	MemoryMB     int64      `json:"memory_mb"`
	CreatedAt    *time.Time `json:"created_at"`
	IPv4         string     `json:"discovered_ipv4"`
	Nets         []struct {
		IPv4 *struct {
			Address string `json:"address"`
		} `json:"ipv4"`
	} `json:"nets"`
	AppVM *struct {
		IP    string `json:"ip"`
		Lease *struct {
			IP string `json:"ip"`
		} `json:"lease"`
	} `json:"appvm"`
	FailureReason *struct {
		Summary string `json:"summary"`
		Cause   string `json:"cause"`
	} `json:"failure_reason"`
	Labels map[string]string `json:"labels"`
}

// cleanStop reports whether the VM's failure_reason records a stop that
// was asked for (by the operator or by the guest powering off), which a
// table shows as the last stop, not as a failure.
func (v *vmView) cleanStop() bool {
	return v.State == "stopped" && v.FailureReason != nil &&
		(v.FailureReason.Cause == "operator_shutdown" || v.FailureReason.Cause == "guest_shutdown")
}

// ipv4 is the address the table shows: the observed one, else the static
// one an AppVM or the first interface was given.
func (v *vmView) ipv4() string {
	switch {
	case v.IPv4 != "":
		return v.IPv4
	case v.AppVM != nil && v.AppVM.IP != "":
		return v.AppVM.IP
	case v.AppVM != nil && v.AppVM.Lease != nil:
		return v.AppVM.Lease.IP
	}
	for _, n := range v.Nets {
		if n.IPv4 != nil && n.IPv4.Address != "" {
			addr, _, _ := strings.Cut(n.IPv4.Address, "/")
			return addr
		}
	}
	return "-"
}

// age is how long ago t was, in the largest whole unit: 45s, 12m, 3h, 5d.
func age(now time.Time, t *time.Time) string {
	if t == nil || t.IsZero() {
		return "-"
	}
	d := now.Sub(*t)
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return strconv.Itoa(int(d/time.Second)) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d/time.Minute)) + "m"
	case d < 48*time.Hour:
		return strconv.Itoa(int(d/time.Hour)) + "h"
	}
	return strconv.Itoa(int(d/(24*time.Hour))) + "d"
}

// mib prints a size in MiB as MiB or, when whole, GiB.
func mib(n int64) string {
	if n >= 1024 && n%1024 == 0 {
		return strconv.FormatInt(n/1024, 10) + "GiB"
	}
	return strconv.FormatInt(n, 10) + "MiB"
}

func bytesSize(n int64) string {
	const gib = 1 << 30
	if n >= gib && n%gib == 0 {
		return strconv.FormatInt(n/gib, 10) + "GiB"
	}
	return mib(n >> 20) // below a GiB or not whole: MiB, rounded down
}

func newTable(w io.Writer) *tabwriter.Writer { return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0) }

func (e *env) vmTable(vms []vmView) {
	tw := newTable(e.stdout)
	fmt.Fprintln(tw, "ID\tMODE\tSTATE\tDISPLAY STATE\tVCPUS\tMEMORY\tIPV4\tAGE")
	for i := range vms {
		v := &vms[i]
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", v.ID, v.Mode, v.State, v.DisplayState, v.VCPUs, mib(v.MemoryMB), v.ipv4(), age(e.now, v.CreatedAt))
	}
	tw.Flush()
	if len(vms) == 1 && vms[0].FailureReason != nil {
		what := "failure"
		if vms[0].cleanStop() {
			what = "last stop"
		}
		fmt.Fprintf(e.stdout, "%s: %s\n", what, vms[0].FailureReason.Summary)
	}
	if len(vms) == 1 && len(vms[0].Labels) > 0 {
		fmt.Fprintf(e.stdout, "labels: %s\n", labelLine(vms[0].Labels))
	}
}

// vmCmd runs `vmhost vm …` (family "vm") and `vmhost appvm …`.
func (e *env) vmCmd(family string, args []string) error {
	prefix := "/api/vms"
	if family == "appvm" {
		prefix = "/api/appvm/vms"
	}
	if len(args) == 0 {
		verbs := "list, get, create, start, stop, shutdown, pause, resume, reboot, balloon, label, delete, wait, console-log, suspend, snapshot, restore"
		if family == "appvm" {
			verbs += ", edit, redeploy, logs, exec, cp, kill"
		}
		return usageError("%s: no subcommand (%s)", family, verbs)
	}
	sub := args[0]
	switch {
	case sub == "exec" || sub == "cp" || sub == "kill":
		if family != "appvm" {
			return usageError("%s: %s is for AppVMs (vmhost appvm %s)", family, sub, sub)
		}
		return map[string]func([]string) error{"exec": e.execCmd, "cp": e.cpCmd, "kill": e.killCmd}[sub](args[1:])
	case isGuestRead(sub):
		return e.guestReadCmd(family, prefix, args)
	}
	name := family + " " + sub
	var file, fromSnapshot, snapshotID string
	var force, restart, cold, memory bool
	var filters labelFilters
	pos, err := e.parse(name, args[1:], func(fs *flag.FlagSet) {
		switch sub {
		case "list":
			fs.Var(&filters, "label", "only VMs with this label: KEY=VALUE, or KEY for any value (repeatable: all must match)")
		case "create":
			fs.StringVar(&file, "f", "", "JSON create body (docs/api.md); - for stdin")
			fs.StringVar(&fromSnapshot, "from-snapshot", "", "the VM's disks are copies of this snapshot's (sets from_snapshot in the body)")
		case "start":
			fs.BoolVar(&cold, "cold", false, "discard a saved state (a suspend's) and boot")
		case "snapshot":
			fs.StringVar(&snapshotID, "id", "", "the snapshot's id (default: a generated UUID)")
			fs.BoolVar(&memory, "memory", false, "also save its memory and device state when it runs (or is suspended)")
		case "edit":
			fs.StringVar(&file, "f", "", "JSON object of the spec fields to change (docs/api.md, PATCH /api/appvm/vms/{id}/spec); - for stdin")
			fs.BoolVar(&restart, "restart", false, "restart the AppVM now on the new spec (else a running one keeps the old until its next boot)")
		case "delete":
			fs.BoolVar(&force, "force", false, "delete a running VM (stopping it) or cancel a provision in progress")
		}
	})
	if err != nil {
		return err
	}
	want := 1
	switch sub {
	case "list", "create":
		want = 0
	case "balloon", "restore":
		want = 2
	case "label":
		want = -1 // the VM id and at least one edit: labelEdit checks
	case "get", "start", "stop", "shutdown", "pause", "resume", "reboot", "delete", "suspend", "snapshot":
	case "edit", "redeploy":
		if family != "appvm" {
			return usageError("%s: %s is for AppVMs (vmhost appvm %s)", family, sub, sub)
		}
	default:
		return usageError("%s: unknown subcommand %q", family, sub)
	}
	if want < 0 && len(pos) == 0 {
		return usageError("%s: want a VM id, then KEY=VALUE or KEY- edits", name)
	}
	if want >= 0 && len(pos) != want {
		switch want {
		case 0:
			return usageError("%s: unexpected argument %q", name, pos[0])
		case 2:
			if sub == "restore" {
				return usageError("%s: want a VM id and a snapshot id", name)
			}
			return usageError("%s: want a VM id and the MiB to reclaim", name)
		}
		return usageError("%s: want one VM id", name)
	}
	if (sub == "create" || sub == "edit") && file == "" {
		return usageError("%s: -f FILE is required", name)
	}
	var labelBody []byte
	if sub == "label" {
		if labelBody, err = labelEdit(name, pos[1:]); err != nil {
			return err
		}
	}
	var balloon uint64
	if sub == "balloon" {
		if balloon, err = strconv.ParseUint(pos[1], 10, 32); err != nil {
			return usageError("%s: %q is not a number of MiB", name, pos[1])
		}
	}
	if err := e.connect(); err != nil {
		return err
	}
	switch sub {
	case "list":
		_, b, err := e.client.do(e.ctx, "GET", prefix+filters.query(), nil)
		if err != nil {
			return err
		}
		if e.opts.output == "json" {
			e.raw(b)
			return nil
		}
		var l struct {
			VMs []vmView `json:"vms"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the VM list: %w", err)
		}
		e.vmTable(l.VMs)
		return nil
	case "get":
		return e.showVM(prefix, pos[0])
	case "create":
		body, err := e.readFile(file)
		if err != nil {
			return err
		}
		if fromSnapshot != "" {
			if body, err = setField(body, "from_snapshot", fromSnapshot); err != nil {
				return usageError("%s: %s: %v", name, file, err)
			}
		}
		_, b, err := e.client.do(e.ctx, "POST", prefix, body)
		if err != nil {
			return err
		}
		if e.opts.output == "json" {
			e.raw(b)
			return nil
		}
		if family == "appvm" {
			var r struct {
				ID      string `json:"id"`
				ImageID string `json:"image_id"`
				Booted  bool   `json:"booted"`
			}
			if err := json.Unmarshal(b, &r); err != nil {
				return fmt.Errorf("decoding the create answer: %w", err)
			}
			// The create answer is short (id, mode, image_id, booted):
			// show the view.
			return e.showVM(prefix, r.ID)
		}
		return e.printVM(b)
	case "edit":
		body, err := e.readFile(file)
		if err != nil {
			return err
		}
		path := prefix + "/" + url.PathEscape(pos[0]) + "/spec"
		if restart {
			path += "?restart=true"
		}
		_, b, err := e.client.do(e.ctx, "PATCH", path, body)
		if err != nil {
			return err
		}
		return e.printVM(b)
	case "label":
		_, b, err := e.client.do(e.ctx, "PATCH", prefix+"/"+url.PathEscape(pos[0])+"/labels", labelBody)
		if err != nil {
			return err
		}
		return e.printVM(b)
	case "redeploy":
		// 202 with the view, redeploying true: the work goes on.
		_, b, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/redeploy", nil)
		if err != nil {
			return err
		}
		return e.printVM(b)
	case "balloon":
		body, _ := json.Marshal(map[string]uint64{"balloon_mb": balloon})
		if _, _, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/balloon", body); err != nil {
			return err
		}
		e.done(fmt.Sprintf("%s: balloon set to %d MiB", pos[0], balloon))
		return nil
	case "suspend":
		if _, _, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/suspend", nil); err != nil {
			return err
		}
		e.done(pos[0] + ": suspended (a start resumes it)")
		return nil
	case "snapshot":
		body, _ := json.Marshal(vmSnapshotRequest{ID: snapshotID, Memory: memory})
		_, b, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/snapshots", body)
		if err != nil {
			return err
		}
		return e.printSnapshots(b, false)
	case "restore":
		body, _ := json.Marshal(map[string]string{"snapshot_id": pos[1]})
		_, b, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/restore", body)
		if err != nil {
			return err
		}
		return e.printVM(b)
	case "start":
		path := prefix + "/" + url.PathEscape(pos[0]) + "/start"
		if cold {
			path += "?cold=true"
		}
		if _, _, err := e.client.do(e.ctx, "POST", path, nil); err != nil {
			return err
		}
		e.done(pos[0] + ": start accepted")
		return nil
	case "delete":
		path := prefix + "/" + url.PathEscape(pos[0])
		if force {
			path += "?force=true"
		}
		if _, _, err := e.client.do(e.ctx, "DELETE", path, nil); err != nil {
			return err
		}
		e.done(pos[0] + ": deleted")
		return nil
	}
	// A lifecycle action: 204 means accepted, not done.
	if _, _, err := e.client.do(e.ctx, "POST", prefix+"/"+url.PathEscape(pos[0])+"/"+sub, nil); err != nil {
		return err
	}
	e.done(pos[0] + ": " + sub + " accepted")
	return nil
}

// printVM prints a VM's view: as is with -o json, else as a table.
func (e *env) printVM(b []byte) error {
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	var v vmView
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("decoding the VM: %w", err)
	}
	e.vmTable([]vmView{v})
	return nil
}

// listAll runs `vmhost list`: the classic VMs and the AppVMs in one
// table, by id; -o json prints {"vms":[…]} with both lists' views as the
// API gave them.
func (e *env) listAll(args []string) error {
	var filters labelFilters
	pos, err := e.parse("list", args, func(fs *flag.FlagSet) {
		fs.Var(&filters, "label", "only VMs with this label: KEY=VALUE, or KEY for any value (repeatable: all must match)")
	})
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("list: unexpected argument %q", pos[0])
	}
	if err := e.connect(); err != nil {
		return err
	}
	var raws []json.RawMessage
	var views []vmView
	for _, path := range []string{"/api/vms", "/api/appvm/vms"} {
		_, b, err := e.client.do(e.ctx, "GET", path+filters.query(), nil)
		if err != nil {
			return err
		}
		var l struct {
			VMs []json.RawMessage `json:"vms"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the VM list of %s: %w", path, err)
		}
		for _, r := range l.VMs {
			var v vmView
			if err := json.Unmarshal(r, &v); err != nil {
				return fmt.Errorf("decoding the VM list of %s: %w", path, err)
			}
			raws, views = append(raws, r), append(views, v)
		}
	}
	order := make([]int, len(views))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return strings.Compare(views[a].ID, views[b].ID) })
	if e.opts.output == "json" {
		sorted := make([]json.RawMessage, len(order))
		for i, j := range order {
			sorted[i] = raws[j]
		}
		b, err := json.Marshal(struct {
			VMs []json.RawMessage `json:"vms"`
		}{sorted})
		if err != nil {
			return err
		}
		e.raw(b)
		return nil
	}
	sorted := make([]vmView, len(order))
	for i, j := range order {
		sorted[i] = views[j]
	}
	e.vmTable(sorted)
	return nil
}

// done reports an action without an answer body, in table mode only (-o
// json prints the body, which is empty).
func (e *env) done(msg string) {
	if e.opts.output == "table" {
		fmt.Fprintln(e.stdout, msg)
	}
}

func (e *env) showVM(prefix, id string) error {
	_, b, err := e.client.do(e.ctx, "GET", prefix+"/"+url.PathEscape(id), nil)
	if err != nil {
		return err
	}
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	var v vmView
	if err := json.Unmarshal(b, &v); err != nil {
		return fmt.Errorf("decoding the VM: %w", err)
	}
	e.vmTable([]vmView{v})
	return nil
}

// readFile reads a create body: a file, or stdin for "-".
func (e *env) readFile(name string) ([]byte, error) {
	if name == "-" {
		b, err := io.ReadAll(e.stdin)
		if err != nil {
			return nil, fmt.Errorf("reading stdin: %w", err)
		}
		return b, nil
	}
	b, err := os.ReadFile(name)
	if err != nil {
		return nil, fmt.Errorf("reading -f: %w", err)
	}
	return b, nil
}

// volumeView holds the fields of a Volume (docs/api.md, Volumes) the table
// shows.
type volumeView struct {
	ID         string     `json:"id"`
	Format     string     `json:"format"`
	Size       int64      `json:"virtual_size_bytes"`
	CreatedAt  *time.Time `json:"created_at"`
	AttachedTo *struct {
		VMID   string `json:"vm_id"`
		Mode   string `json:"mode"`
		Device string `json:"device"`
	} `json:"attached_to"`
	Path string `json:"path"`
}

func (e *env) volumeTable(vols []volumeView) {
	tw := newTable(e.stdout)
	fmt.Fprintln(tw, "ID\tFORMAT\tSIZE\tATTACHED TO\tAGE\tPATH")
	for _, v := range vols {
		att := "-"
		if v.AttachedTo != nil {
			att = v.AttachedTo.Mode + "/" + v.AttachedTo.VMID + " " + v.AttachedTo.Device
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", v.ID, v.Format, bytesSize(v.Size), att, age(e.now, v.CreatedAt), v.Path)
	}
	tw.Flush()
}

// volumeCmd runs `vmhost volume …` over the volume routes.
func (e *env) volumeCmd(args []string) error {
	if len(args) == 0 {
		return usageError("volume: no subcommand (list, get, create, delete, attach, detach)")
	}
	sub := args[0]
	var (
		id, format, volID, mountpoint string
		sizeGiB                       int
		readonly, appvm               bool
	)
	pos, err := e.parse("volume "+sub, args[1:], func(fs *flag.FlagSet) {
		switch sub {
		case "create":
			fs.StringVar(&id, "id", "", "volume id (default: a generated UUID)")
			fs.IntVar(&sizeGiB, "size-gib", 0, "size in GiB (1..65535)")
			fs.StringVar(&format, "format", "", "raw (a blank disk, the default) or ext4 (an empty ext4 file system)")
		case "attach":
			fs.StringVar(&volID, "volume", "", "first-class volume to attach")
			fs.IntVar(&sizeGiB, "size-gib", 0, "make and attach a new blank VM-owned volume of this size instead")
			fs.BoolVar(&readonly, "readonly", false, "attach read-only")
			fs.StringVar(&mountpoint, "mountpoint", "", "where an AppVM mounts it (--appvm)")
			fs.BoolVar(&appvm, "appvm", false, "VM is an AppVM")
		case "detach":
			fs.BoolVar(&appvm, "appvm", false, "VM is an AppVM")
		}
	})
	if err != nil {
		return err
	}
	want := map[string]int{"list": 0, "get": 1, "create": 0, "delete": 1, "attach": 1, "detach": 2}
	n, ok := want[sub]
	if !ok {
		return usageError("volume: unknown subcommand %q", sub)
	}
	if len(pos) != n {
		return usageError("volume %s: want %d argument(s), got %d", sub, n, len(pos))
	}
	var body []byte
	switch sub {
	case "create":
		if sizeGiB < 1 {
			return usageError("volume create: --size-gib N is required")
		}
		body, _ = json.Marshal(struct {
			ID      string `json:"volume_id,omitempty"`
			SizeGiB int    `json:"size_gib"`
			Format  string `json:"format,omitempty"`
		}{id, sizeGiB, format})
	case "attach":
		if (volID == "") == (sizeGiB == 0) {
			return usageError("volume attach: give exactly one of --volume ID and --size-gib N")
		}
		body, _ = json.Marshal(struct {
			VolumeID   string `json:"volume_id,omitempty"`
			SizeGiB    int    `json:"size_gib,omitempty"`
			Readonly   bool   `json:"readonly,omitempty"`
			Mountpoint string `json:"mountpoint,omitempty"`
		}{volID, sizeGiB, readonly, mountpoint})
	}
	if err := e.connect(); err != nil {
		return err
	}
	vmPrefix := "/api/vms/"
	if appvm {
		vmPrefix = "/api/appvm/vms/"
	}
	var method, path string
	switch sub {
	case "list":
		method, path = "GET", "/api/volumes"
	case "get":
		method, path = "GET", "/api/volumes/"+url.PathEscape(pos[0])
	case "create":
		method, path = "POST", "/api/volumes"
	case "delete":
		method, path = "DELETE", "/api/volumes/"+url.PathEscape(pos[0])
	case "attach":
		method, path = "POST", vmPrefix+url.PathEscape(pos[0])+"/volumes"
	case "detach":
		method, path = "DELETE", vmPrefix+url.PathEscape(pos[0])+"/volumes/"+url.PathEscape(pos[1])
	}
	_, b, err := e.client.do(e.ctx, method, path, body)
	if err != nil {
		return err
	}
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	switch sub {
	case "list":
		var l struct {
			Volumes []volumeView `json:"volumes"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the volume list: %w", err)
		}
		e.volumeTable(l.Volumes)
	case "get", "create":
		var v volumeView
		if err := json.Unmarshal(b, &v); err != nil {
			return fmt.Errorf("decoding the volume: %w", err)
		}
		e.volumeTable([]volumeView{v})
	case "delete":
		e.done(pos[0] + ": deleted")
	case "attach", "detach": // the VM's view
		var v vmView
		if err := json.Unmarshal(b, &v); err != nil {
			return fmt.Errorf("decoding the VM: %w", err)
		}
		e.vmTable([]vmView{v})
	}
	return nil
}

// imageView holds the fields of an AppVM image catalog entry the table
// shows.
type imageView struct {
	ID        string     `json:"id"`
	Status    string     `json:"status"`
	CreatedAt *time.Time `json:"created_at"`
	Source    string     `json:"source"`
	Failure   string     `json:"failure"`
	Reimport  *struct {
		Status string `json:"status"`
	} `json:"reimport"`
}

func (e *env) imageTable(imgs []imageView) {
	tw := newTable(e.stdout)
	fmt.Fprintln(tw, "ID\tSTATUS\tREIMPORT\tAGE\tSOURCE")
	for _, i := range imgs {
		re := "-"
		if i.Reimport != nil {
			re = i.Reimport.Status
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", i.ID, i.Status, re, age(e.now, i.CreatedAt), i.Source)
	}
	tw.Flush()
	if len(imgs) == 1 && imgs[0].Failure != "" {
		fmt.Fprintf(e.stdout, "failure: %s\n", imgs[0].Failure)
	}
}

// imageCmd runs `vmhost image list|get|import|delete` through the API. The
// offline import (`vmhost image import --state-dir DIR …`) is main's.
func (e *env) imageCmd(args []string) error {
	if len(args) == 0 {
		return usageError("image: no subcommand (list, get, import, delete)")
	}
	sub := args[0]
	var id string
	pos, err := e.parse("image "+sub, args[1:], func(fs *flag.FlagSet) {
		if sub == "import" {
			fs.StringVar(&id, "id", "", "image id (the VM id pattern)")
		}
	})
	if err != nil {
		return err
	}
	want := map[string]int{"list": 0, "get": 1, "import": 1, "delete": 1}
	n, ok := want[sub]
	if !ok {
		return usageError("image: unknown subcommand %q", sub)
	}
	if len(pos) != n {
		return usageError("image %s: want %d argument(s), got %d", sub, n, len(pos))
	}
	var body []byte
	if sub == "import" {
		if id == "" {
			return usageError("image import: --id ID is required")
		}
		// The agent reads PATH on its own host: a relative path is taken
		// from this directory, which is right when client and agent share
		// the host.
		path := pos[0]
		if !filepath.IsAbs(path) {
			abs, err := filepath.Abs(path)
			if err != nil {
				return err
			}
			path = abs
		}
		body, _ = json.Marshal(struct {
			ID   string `json:"id"`
			Path string `json:"path"`
		}{id, path})
	}
	if err := e.connect(); err != nil {
		return err
	}
	var method, path string
	switch sub {
	case "list":
		method, path = "GET", "/api/appvm/images"
	case "get":
		method, path = "GET", "/api/appvm/images/"+url.PathEscape(pos[0])
	case "import":
		method, path = "POST", "/api/appvm/images"
	case "delete":
		method, path = "DELETE", "/api/appvm/images/"+url.PathEscape(pos[0])
	}
	_, b, err := e.client.do(e.ctx, method, path, body)
	if err != nil {
		return err
	}
	if e.opts.output == "json" {
		e.raw(b)
		return nil
	}
	switch sub {
	case "list":
		var l struct {
			Images []imageView `json:"images"`
		}
		if err := json.Unmarshal(b, &l); err != nil {
			return fmt.Errorf("decoding the image list: %w", err)
		}
		e.imageTable(l.Images)
	case "get", "import":
		var i imageView
		if err := json.Unmarshal(b, &i); err != nil {
			return fmt.Errorf("decoding the image: %w", err)
		}
		e.imageTable([]imageView{i})
	case "delete":
		e.done(pos[0] + ": deleted")
	}
	return nil
}
