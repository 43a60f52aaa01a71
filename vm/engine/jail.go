package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"vmhost/chclient"
	"vmhost/internal/nofollow"
	"vmhost/jail"
	"vmhost/proc"
	"vmhost/vm/record"
)

// Confinement of a VM's processes (docs/operating.md, Confinement): with
// Options.Jail enabled, every VM gets a uid and gid of its own and a cgroup
// (record.Confinement), in the create's own record (Claim), before any
// host work: so the records name every id and cgroup the host holds, and
// no two records ever hold one id. Its qemu-storage-daemon and Cloud Hypervisor
// then run as that uid, without capabilities, in a root of their own that
// holds only their files, in the VM's cgroup (package jail).
//
// The VM owns what its processes open or create: its disks and seed (the
// VM directory itself stays root's, mode 0711, so the VM can reach its
// files but not add or list any), its run directory (where they create
// their sockets), its taps (TUNSETOWNER) and the guest agent's vsock
// listener. A first-class volume is reached through a hard link in
// <state>/vms/<id>/volumes/, since nothing can be mounted into a running
// jail: the link is made (and the volume given to the VM) before the
// storage daemon opens it, and the volume is given back to root when it
// leaves the VM. The agent itself never follows a link in a run directory
// (package internal/nofollow).
//
// A VM whose record has no jail (created by an agent without root, or
// booted by an older vmhost) runs unconfined until its next boot, which
// gives it one first. A stop kills whatever is left in the VM's cgroup; a
// delete or a failed create kills it and removes it. Recovery finds a
// running VM's processes by its cgroup and checks their confinement, and
// removes the cgroups of this agent that no record names.

// jailer returns the agent's jailer, nil when VMs run unconfined.
func (e *Engine) jailer() *jail.Jailer {
	if j := e.o.Jail; j != nil && j.Enabled() {
		return j
	}
	return nil
}

// vmJail returns the jail of rec, nil when it has none or VMs run
// unconfined.
func (e *Engine) vmJail(rec *record.Record) *jail.VM {
	j := e.jailer()
	if j == nil || rec == nil || rec.Jail == nil {
		return nil
	}
	v, err := j.VM(rec.ID, rec.Jail.UID)
	if err != nil {
		e.log.Error("the VM's recorded jail is not usable", "id", rec.ID, "uid", rec.Jail.UID, "err", err)
		return nil
	}
	return v
}

// confines reports whether rec's processes are to be confined.
func (e *Engine) confines(rec *record.Record) bool {
	return e.jailer() != nil && !(rec.Mode == record.ModeAppVM && e.o.AppVMsUnconfined != "")
}

// Claim gives rec, a create being admitted, its jail: a uid and gid no
// other record (others: every stored record and create in flight) holds
// and none being recorded (jailGiven). It runs under the records' lock
// (Registry.Reserve), so the create's first record write holds its jail
// and two creates never get one id.
func (e *Engine) Claim(rec *record.Record, others []*record.Record) error {
	if rec.Jail != nil || !e.confines(rec) {
		return nil
	}
	e.jailMu.Lock()
	defer e.jailMu.Unlock()
	c, err := e.allocJail(rec.ID, others)
	if err != nil {
		return err
	}
	rec.Jail = c
	return nil
}

// allocJail returns a jail for VM id whose id no record of recs (but id's)
// and no jail being recorded holds. jailMu must be held, and the records'
// lock, so that recs stays what the registry holds.
func (e *Engine) allocJail(id string, recs []*record.Record) (*record.Confinement, error) {
	j := e.jailer()
	inUse := map[uint32]bool{}
	for _, r := range recs {
		if r.ID != id && r.Jail != nil {
			inUse[r.Jail.UID] = true
		}
	}
	for uid := range e.jailGiven {
		inUse[uid] = true
	}
	uid, err := j.AllocateID(inUse)
	if err != nil {
		return nil, &record.HostError{Kind: record.HostInternal, Op: "confining VM " + id, Err: err}
	}
	return &record.Confinement{UID: uid, GID: uid, Cgroup: j.CgroupName(id)}, nil
}

// recordJail gives rec a jail when it has none and records it: the
// intent, before the host work that depends on it (the boot, or a
// provision's steps not yet done, of a VM created while VMs ran
// unconfined; a create gets its jail in its own record: Claim). The id is
// chosen under the records' lock, as Claim does, and stays in jailGiven
// until the record is stored with it, so the write itself (an fsync) runs
// outside the lock.
func (e *Engine) recordJail(rec *record.Record) (*record.Record, error) {
	if rec.Jail != nil || !e.confines(rec) {
		return rec, nil
	}
	var (
		c   *record.Confinement
		err error
	)
	e.recs.View(func(recs []*record.Record) {
		e.jailMu.Lock()
		defer e.jailMu.Unlock()
		if c, err = e.allocJail(rec.ID, recs); err == nil {
			e.jailGiven[c.UID] = true
		}
	})
	if err != nil {
		return nil, err
	}
	defer func() {
		e.jailMu.Lock()
		delete(e.jailGiven, c.UID) // its record holds it now, or it was not given
		e.jailMu.Unlock()
	}()
	r, err := e.update(rec.ID, func(r *record.Record) {
		if r.Jail == nil {
			r.Jail = c
		}
	})
	if err != nil {
		return nil, err
	}
	if rec.Runtime.Done(record.StepRootDisk) { // not a new VM's provision
		e.log.Info("VM confined from this boot on", "id", rec.ID, "uid", c.UID, "cgroup", c.Cgroup)
	}
	return r, nil
}

// startCgroup makes the cgroup of rec (with its jail recorded) in the
// background, and returns the wait for it; nil when rec is not confined. A
// provision has it made while the VM's disks are: on v1 a new cgroup is a
// directory and limits in four hierarchies, about what a jailed start
// costs. The wait must be called before the provision returns, so that a
// rollback never races with it.
func (e *Engine) startCgroup(rec *record.Record) func() error {
	v := e.vmJail(rec)
	if v == nil {
		return nil
	}
	lim := e.jailer().Config().Limits(rec.Spec.MemoryMB, rec.Spec.Vcpus)
	done := make(chan struct{})
	var err error
	go func() {
		defer close(done)
		err = v.Create(lim)
	}()
	return func() error {
		<-done
		return err
	}
}

// prepareJail readies rec's jail before a process of it starts: its jail is
// recorded (recordJail), its cgroup made with the VM's limits (kept if it
// exists, the limits written again: the VM's size may have changed), and
// its disks, seed, volume links and run directory given to it. It returns
// the record (with its jail) and the jail, nil when VMs run unconfined.
// cgroupMade, when not nil, is the wait for the cgroup a provision is
// making (startCgroup), which then takes the place of making it here.
func (e *Engine) prepareJail(rec *record.Record, cgroupMade func() error) (*record.Record, *jail.VM, error) {
	rec, err := e.recordJail(rec)
	if err != nil {
		return nil, nil, err
	}
	v := e.vmJail(rec)
	if v == nil {
		return rec, nil, nil
	}
	fail := func(err error) error {
		return &record.HostError{Kind: record.HostInternal, Op: "confining VM " + rec.ID, Err: err}
	}
	if cgroupMade != nil {
		err = cgroupMade()
	} else {
		err = v.Create(e.jailer().Config().Limits(rec.Spec.MemoryMB, rec.Spec.Vcpus))
	}
	if err != nil {
		return nil, nil, fail(err)
	}
	if err := e.giveFiles(rec, v); err != nil {
		return nil, nil, fail(err)
	}
	return rec, v, nil
}

// giveFiles gives the VM what its processes open: the VM directory is
// made reachable (0711, root's), its disks and seed become the VM's, each
// first-class volume is linked into it, links of volumes it no longer has
// are removed, and its run directory becomes the VM's with everything in
// it.
func (e *Engine) giveFiles(rec *record.Record, v *jail.VM) error {
	l, id := e.layout(), rec.ID
	if err := os.MkdirAll(l.VMDir(id), 0o700); err != nil {
		return err
	}
	if err := os.Chmod(l.VMDir(id), 0o711); err != nil {
		return err
	}
	var own []string
	for _, p := range []string{l.RootDisk(id), l.Seed(id)} {
		if _, err := os.Lstat(p); err == nil {
			own = append(own, p)
		}
	}
	for _, vol := range rec.Spec.Volumes {
		if vol.VolumeID == "" {
			if _, err := os.Lstat(l.DataVolume(id, vol.ID)); err == nil {
				own = append(own, l.DataVolume(id, vol.ID))
			}
		}
	}
	if err := jail.Own(v.UID, v.GID, own...); err != nil {
		return err
	}
	if err := e.syncVolumeLinks(rec, v); err != nil {
		return err
	}
	if err := os.MkdirAll(l.RunVMDir(id), 0o700); err != nil {
		return err
	}
	return jail.OwnTree(v.UID, v.GID, l.RunVMDir(id))
}

// volumeLinks is the directory of the hard links through which a confined
// VM reaches its first-class volumes.
func (e *Engine) volumeLinks(id string) string { return e.layout().VMDir(id) + "/volumes" }

// volumeLink is the link of first-class volume vid in VM id's directory.
func (e *Engine) volumeLink(id, vid string) string { return e.volumeLinks(id) + "/" + vid + ".qcow2" }

// volumePath is where VM id's storage daemon opens volume v: for a confined
// VM's first-class volume, its link.
func (e *Engine) volumePath(rec *record.Record, v record.VolumeSpec) string {
	if v.VolumeID != "" && e.vmJail(rec) != nil {
		return e.volumeLink(rec.ID, v.VolumeID)
	}
	return e.layout().VolumeFile(rec.ID, v)
}

// linkVolume makes the hard link of first-class volume v in rec's VM
// directory (replacing a stale one) and gives the volume to the VM.
func (e *Engine) linkVolume(rec *record.Record, v record.VolumeSpec, jv *jail.VM) error {
	if v.VolumeID == "" {
		return nil
	}
	src, link := e.layout().Volume(v.VolumeID), e.volumeLink(rec.ID, v.VolumeID)
	if err := os.MkdirAll(e.volumeLinks(rec.ID), 0o711); err != nil {
		return err
	}
	if err := os.Chmod(e.volumeLinks(rec.ID), 0o711); err != nil {
		return err
	}
	if !sameFile(src, link) {
		if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		if err := os.Link(src, link); err != nil {
			return fmt.Errorf("linking volume %s into the VM's directory (a confined VM's volumes must be on the state directory's file system): %w", v.VolumeID, err)
		}
	}
	return jail.Own(jv.UID, jv.GID, link)
}

// unlinkVolume removes the link of first-class volume vid from VM id's
// directory and gives the volume back to root, unless another VM has it.
func (e *Engine) unlinkVolume(id, vid string) error {
	link := e.volumeLink(id, vid)
	if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return e.disownVolume(vid, id)
}

// disownVolume gives first-class volume vid back to root unless a record
// other than VM id's has it.
func (e *Engine) disownVolume(vid, id string) error {
	taken := false
	e.recs.Each(func(r *record.Record) {
		if r.ID != id && slices.ContainsFunc(r.Spec.Volumes, func(v record.VolumeSpec) bool { return v.VolumeID == vid }) {
			taken = true
		}
	})
	if taken {
		return nil
	}
	err := jail.Disown(e.layout().Volume(vid))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return err
}

// syncVolumeLinks links every first-class volume of rec into its VM
// directory and removes the links of volumes it no longer has (a detach
// while it did not run, or cut short), giving those back to root.
func (e *Engine) syncVolumeLinks(rec *record.Record, v *jail.VM) error {
	want := map[string]bool{}
	for _, vol := range rec.Spec.Volumes {
		if vol.VolumeID != "" {
			want[vol.VolumeID+".qcow2"] = true
			if err := e.linkVolume(rec, vol, v); err != nil {
				return err
			}
		}
	}
	ents, err := os.ReadDir(e.volumeLinks(rec.ID))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, ent := range ents {
		if want[ent.Name()] {
			continue
		}
		if err := e.unlinkVolume(rec.ID, strings.TrimSuffix(ent.Name(), ".qcow2")); err != nil {
			return err
		}
	}
	return nil
}

// disownVolumes gives rec's first-class volumes back to root (a delete:
// they outlive the VM).
func (e *Engine) disownVolumes(rec *record.Record) error {
	var errs []error
	for _, v := range rec.Spec.Volumes {
		if v.VolumeID != "" && rec.Jail != nil {
			errs = append(errs, e.disownVolume(v.VolumeID, rec.ID))
		}
	}
	return errors.Join(errs...)
}

func sameFile(a, b string) bool {
	fa, err := os.Stat(a)
	if err != nil {
		return false
	}
	fb, err := os.Lstat(b)
	return err == nil && os.SameFile(fa, fb)
}

// killJail kills whatever is left in VM id's cgroup: a stopped or failed VM
// runs nothing (a child its CH forked, a stuck storage daemon). The cgroup
// stays for the next boot.
func (e *Engine) killJail(rec *record.Record) {
	v := e.vmJail(rec)
	if v == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := v.Cgroup().Kill(ctx); err != nil {
		e.log.Error("killing what is left in the VM's cgroup", "id", rec.ID, "err", err)
	}
}

// destroyJail kills everything in rec's cgroup and removes it (a delete, a
// rolled-back create).
func (e *Engine) destroyJail(ctx context.Context, rec *record.Record) error {
	v := e.vmJail(rec)
	if v == nil {
		return nil
	}
	return v.Destroy(ctx)
}

// confineCH is how rec's Cloud Hypervisor starts in jail v: it sees its
// VM's directory (the seed) and run directory (its sockets), the payload
// files, the sysfs nodes of its taps and devices, the device nodes it
// opens, and a /proc of its own processes; with VFIO its guest memory may
// be locked. cfg is the vm.create body it will be given.
func (e *Engine) confineCH(rec *record.Record, v *jail.VM, files []string) proc.Confiner {
	l, id, sp := e.layout(), rec.ID, &rec.Spec
	x := jail.Exec{
		Binds: []jail.Bind{
			// Writable for vm.snapshot, which writes into a directory
			// under the save directory the VM owns; the VM directory is
			// root's (0711), so CH writes nothing else there but the
			// files the VM owns, which its storage daemon writes anyway.
			{Path: l.VMDir(id), Writable: true},
			{Path: l.RunVMDir(id), Writable: true, Exec: e.o.CH.ExecRunDir},
		},
		Devices: []string{"/dev/kvm", "/dev/urandom", "/dev/null"},
		Proc:    true,
	}
	for _, f := range files {
		x.Binds = append(x.Binds, jail.Bind{Path: f})
	}
	if len(rec.NICs) > 0 {
		x.Devices = append(x.Devices, "/dev/net/tun")
		for _, n := range rec.NICs {
			// CH reads tun_flags there. An agent in a network namespace
			// whose sysfs was not mounted for it sees no such node, and
			// neither would CH.
			if p := "/sys/class/net/" + n.Tap; fileExists(p) {
				x.Binds = append(x.Binds, jail.Bind{Path: p})
			}
		}
	}
	if len(sp.PCIDevices) > 0 {
		x.Devices = append(x.Devices, "/dev/vfio/vfio")
		for _, bdf := range sp.PCIDevices {
			dev := "/sys/bus/pci/devices/" + bdf
			x.Binds = append(x.Binds, jail.Bind{Path: dev, Writable: true})
			if g, err := os.Readlink(dev + "/iommu_group"); err == nil {
				x.Devices = append(x.Devices, "/dev/vfio/"+filepath.Base(g))
			}
		}
		x.MemlockBytes = (sp.MemoryMB + e.jailer().Config().MemoryOverheadMB) << 20
	}
	x.Binds = append(x.Binds, e.o.CH.Jail.Binds...)
	x.Devices = append(x.Devices, e.o.CH.Jail.Devices...)
	return v.Confine(dedupe(x))
}

// confineQSD is how rec's storage daemon starts in jail v: it sees its VM's
// directory (disks, volume links) and run directory (its sockets), a
// backing build read-only, and /dev/null.
func (e *Engine) confineQSD(rec *record.Record, v *jail.VM, backing string) proc.Confiner {
	l, id := e.layout(), rec.ID
	x := jail.Exec{
		Binds: []jail.Bind{
			{Path: l.VMDir(id), Writable: true},
			{Path: l.RunVMDir(id), Writable: true},
		},
		Devices: []string{"/dev/null"},
	}
	if backing != "" {
		x.Binds = append(x.Binds, jail.Bind{Path: backing})
	}
	x.Binds = append(x.Binds, e.o.QSD.Jail.Binds...)
	x.Devices = append(x.Devices, e.o.QSD.Jail.Devices...)
	return v.Confine(dedupe(x))
}

// dedupe drops repeated device nodes: a program's extra devices may name
// one the engine adds.
func dedupe(x jail.Exec) jail.Exec {
	var devs []string
	for _, d := range x.Devices {
		if !slices.Contains(devs, d) {
			devs = append(devs, d)
		}
	}
	x.Devices = devs
	return x
}

// prepareCH readies the start of rec's Cloud Hypervisor in jail v with the
// vm.create body cfg: the files the boot added to the run directory (the
// guest agent's listener) become the VM's, and the payload files must be
// readable by the VM's uid, which opens them. It returns the confinement.
func (e *Engine) prepareCH(rec *record.Record, v *jail.VM, cfg *chclient.VmConfig) (proc.Confiner, error) {
	if err := jail.OwnTree(v.UID, v.GID, e.layout().RunVMDir(rec.ID)); err != nil {
		return nil, &record.HostError{Kind: record.HostInternal, Op: "confining VM " + rec.ID, Err: err}
	}
	var files []string
	if p := cfg.Payload; p != nil {
		for _, f := range []string{p.Kernel, p.Initramfs, p.Firmware} {
			if f == "" {
				continue
			}
			if err := readableBy(f, v.UID, v.GID); err != nil {
				return nil, &record.HostError{Kind: record.HostInternal, Op: "booting VM " + rec.ID, Err: err}
			}
			files = append(files, f)
		}
	}
	return e.confineCH(rec, v, files), nil
}

// prepareRestore readies the start of rec's Cloud Hypervisor in jail v to
// restore its saved state: as prepareCH for a boot (the payload files of
// the VM's configuration, which the state names), and the suspend
// directory becomes the VM's.
func (e *Engine) prepareRestore(rec *record.Record, v *jail.VM) (proc.Confiner, error) {
	// A missing state is CH's to report, as vm.restore does unconfined.
	if err := jail.OwnTree(v.UID, v.GID, e.layout().SuspendDir(rec.ID)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, &record.HostError{Kind: record.HostInternal, Op: "confining VM " + rec.ID, Err: err}
	}
	cfg, err := CHConfig(rec, e.o.Config, e.layout(), CHConfigHost{CPUs: e.o.HostCPUs})
	if err != nil {
		return nil, &record.HostError{Kind: record.HostInternal, Op: "restoring VM " + rec.ID, Err: err}
	}
	if cfg.Payload != nil && cfg.Payload.Initramfs == "" {
		// An AppVM's initramfs is given at each boot, not recorded: the
		// saved configuration names the one its boot had.
		cfg.Payload.Initramfs = savedInitramfs(e.layout(), e.layout().SuspendDir(rec.ID))
	}
	return e.prepareCH(rec, v, cfg)
}

// savedInitramfs is the initramfs the saved configuration in dir names,
// when it is one the agent can have made there: a regular file of the run
// directory that every user may read. The saved state is the VM's own to
// write, so what it names reaches the jail only if the VM could read it
// anyway; "" otherwise.
func savedInitramfs(l record.Layout, dir string) string {
	b, err := nofollow.ReadFile(filepath.Join(dir, "config.json"))
	if err != nil {
		return ""
	}
	var saved struct {
		Payload struct {
			Initramfs string `json:"initramfs"`
		} `json:"payload"`
	}
	if json.Unmarshal(b, &saved) != nil {
		return ""
	}
	p := saved.Payload.Initramfs
	if p == "" || filepath.Clean(p) != p || filepath.Dir(p) != filepath.Clean(l.RunDir) {
		return ""
	}
	fi, err := os.Lstat(p)
	if err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm()&0o004 == 0 {
		return ""
	}
	return p
}

// readableBy fails, saying why, when uid (with gid) cannot read the file at
// path: a payload a confined Cloud Hypervisor opens as the VM's uid. The
// directories on the way do not matter (the jail shows the file alone).
func readableBy(path string, uid, gid uint32) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return nil
	}
	perm := fi.Mode().Perm()
	switch {
	case st.Uid == uid:
		perm >>= 6
	case st.Gid == gid:
		perm >>= 3
	}
	if perm&4 == 0 {
		return fmt.Errorf("%s (mode %04o, owner %d:%d) is not readable by the VM's uid %d, as which its confined Cloud Hypervisor opens it: make it readable by all (chmod a+r %s)",
			path, fi.Mode().Perm(), st.Uid, st.Gid, uid, path)
	}
	return nil
}

// verifyAdopted checks, for a running VM adopted after an agent restart,
// that its recorded processes (pids) are members of its cgroup and
// confined as its jail confines (jail.VM.Verify), and logs what is not: a
// VM that runs is never stopped for it. A VM without a jail (booted by an
// older vmhost) keeps running unconfined until its next boot.
func (e *Engine) verifyAdopted(rec *record.Record, pids []int) {
	v := e.vmJail(rec)
	if v == nil {
		if e.confines(rec) {
			e.log.Warn("VM runs unconfined (booted before VMs were confined); it is confined from its next boot", "id", rec.ID)
		}
		return
	}
	procs, err := v.Cgroup().Procs()
	if err != nil {
		e.log.Error("listing the processes of an adopted VM's cgroup", "id", rec.ID, "err", err)
		return
	}
	members, err := proc.Members(procs)
	if err != nil {
		e.log.Error("reading the processes of an adopted VM's cgroup", "id", rec.ID, "err", err)
		return
	}
	for _, pid := range pids {
		if !slices.ContainsFunc(members, func(m proc.Member) bool { return m.Pid == pid }) {
			e.log.Error("an adopted VM's process is not in its cgroup", "id", rec.ID, "pid", pid, "cgroup", v.Cgroup().Name())
			continue
		}
		if err := v.Verify(pid); err != nil {
			e.log.Error("an adopted VM's process is not confined as its jail says", "id", rec.ID, "err", err)
		}
	}
}

// reapJails kills and removes the VM cgroups of this agent that no record
// names (a create rolled back by a crash before its record was stored
// never made one: the record comes first; a delete cut short after its
// record went), and returns their VM ids.
func (e *Engine) reapJails() []string {
	j := e.jailer()
	if j == nil {
		return nil
	}
	ids, err := j.Leftovers()
	if err != nil {
		e.log.Warn("cannot list the VM cgroups; orphan cgroups are not reaped", "err", err)
		return nil
	}
	var reaped []string
	for _, id := range ids {
		if e.recs.Get(id) != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		err := j.Destroy(ctx, id)
		cancel()
		if err != nil {
			e.log.Error("removing a VM cgroup no record names", "vm", id, "err", err)
			continue
		}
		e.log.Warn("removed a VM cgroup no record names, with what ran in it", "vm", id)
		reaped = append(reaped, id)
	}
	return reaped
}

// Usage reads rec's cgroup counters (vm.Host): nil for a VM that runs
// unconfined.
func (e *Engine) Usage(rec *record.Record) (*record.Usage, error) {
	v := e.vmJail(e.current(rec))
	if v == nil {
		return nil, nil
	}
	st, err := v.Cgroup().Stats()
	if err != nil {
		return nil, &record.HostError{Kind: record.HostInternal, Op: "reading the cgroup of VM " + rec.ID, Err: err}
	}
	return &record.Usage{CPUSeconds: st.CPU.Seconds(), MemoryBytes: st.MemoryBytes, Pids: st.Pids}, nil
}
