package vm_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"vmhost/store"
	"vmhost/vm"
	"vmhost/vm/record"
	"vmhost/vm/vmtest"
)

// TestAdmission: each resource admission counts, with the create that
// just fits beside the one that does not.
func TestAdmission(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name     string
		resource string
		setup    func(*vmtest.Env)
		first    func(*vm.Spec) // stored before the checked create
		fits     func(*vm.Spec)
		over     func(*vm.Spec)
	}{
		{"vcpus against CPUs x overcommit", "vcpus",
			func(e *vmtest.Env) { e.Config.HostCPUs = 2; e.Config.Overcommit.CPU = 2 },
			func(s *vm.Spec) { s.Vcpus = 3 },
			func(s *vm.Spec) { s.Vcpus = 1 },
			func(s *vm.Spec) { s.Vcpus = 2 }},
		{"memory against host memory x overcommit", "memory_mb",
			func(e *vmtest.Env) { e.Config.HostMemoryMB = 1000; e.Config.Overcommit.Memory = 1.5 },
			func(s *vm.Spec) { s.MemoryMB = 1000 },
			func(s *vm.Spec) { s.MemoryMB = 500 },
			func(s *vm.Spec) { s.MemoryMB = 501 }},
		{"memory at the hypervisor's ceiling", "memory_mb",
			nil,
			func(s *vm.Spec) { s.MemoryMB = 1024 },
			func(s *vm.Spec) { s.MemoryMB = 1024 },
			func(s *vm.Spec) { s.MemoryMB = vm.MaxMemoryMB }},
		{"pinned vCPUs against pinned CPUs", "cpu_affinity",
			func(e *vmtest.Env) { e.Config.Overcommit.CPU = 1 },
			nil,
			func(s *vm.Spec) { s.CPUAffinity = ptr("0-1") },
			func(s *vm.Spec) { s.CPUAffinity = ptr("0") }},
		{"PCI device claimed by another VM", "pci_devices",
			nil,
			func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} },
			func(s *vm.Spec) { s.PCIDevices = []string{"0000:01:00.0", "0000:01:00.1"} },
			func(s *vm.Spec) { s.PCIDevices = []string{"0000:02:00.0"} }},
		{"disk space for the copy", "disk",
			func(e *vmtest.Env) { e.DiskFree = 1 << 30 },
			nil,
			func(s *vm.Spec) {},
			func(s *vm.Spec) {
				s.Image, s.Disk = &vm.ImageSpec{ImageID: "i", ContentSHA256: goodSHA, FetchURL: "http://x/i"}, &vm.DiskSpec{SizeGiB: ptr[uint32](2)}
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := vmtest.NewEnv(t)
			if tt.setup != nil {
				tt.setup(e)
			}
			svc := e.Service(t)
			if tt.first != nil {
				s := baseSpec(e)
				s.Vcpus = 2
				s.VMID = "first"
				tt.first(&s)
				if _, _, err := svc.CreateVM(ctx, &s); err != nil {
					t.Fatalf("first create: %v", err)
				}
			}
			s := baseSpec(e)
			s.VMID = "over"
			s.Vcpus = 2
			tt.over(&s)
			_, _, err := svc.CreateVM(ctx, &s)
			var ce *vm.CapacityError
			if !errors.As(err, &ce) || ce.Resource != tt.resource {
				t.Fatalf("over capacity: CreateVM = %v, want *CapacityError on %s", err, tt.resource)
			}
			s = baseSpec(e)
			s.VMID = "fits"
			s.Vcpus = 2
			tt.fits(&s)
			if _, _, err := svc.CreateVM(ctx, &s); err != nil {
				t.Errorf("fitting create: %v", err)
			}
			svc.Wait()
			if got := e.Host.Calls(); len(got) > 0 && got[len(got)-1] == "preflight over" {
				t.Errorf("the rejected create reached the host: %v", got)
			}
		})
	}
}

// TestAdmissionReadsHostOutsideLock: the host is read (here, free space)
// before the registry is locked, so reads of VMs never wait on that I/O.
// Under the lock, the List in OnDiskFree could not finish until the read did.
func TestAdmissionReadsHostOutsideLock(t *testing.T) {
	e := vmtest.NewEnv(t)
	var svc *vm.Service
	listed := 0
	e.OnDiskFree = func() {
		done := make(chan struct{})
		go func() {
			svc.List(vm.ModeVM)
			close(done)
		}()
		select {
		case <-done:
			listed++
		case <-time.After(10 * time.Second):
			t.Error("reading free space blocked VM reads: the registry is locked around host I/O")
		}
	}
	svc = e.Service(t)
	s := baseSpec(e)
	s.VMID = "a"
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Fatal(err)
	}
	if listed != 1 {
		t.Errorf("free space read %d times with the registry readable, want 1", listed)
	}
}

// TestFailedVMsFreeCapacity: a failed VM holds no vCPUs or memory; only
// VMs that are neither stopped nor failed count.
func TestFailedVMsFreeCapacity(t *testing.T) {
	e := vmtest.NewEnv(t)
	e.Config.HostCPUs, e.Config.Overcommit.CPU = 1, 1
	e.Host.FailProvision = errors.New("download failed")
	svc := e.Service(t)
	s := baseSpec(e)
	s.Vcpus, s.VMID = 1, "dl"
	s.Disk, s.Image = nil, &vm.ImageSpec{ImageID: "i", ContentSHA256: goodSHA, FetchURL: "http://x/i"}
	if _, async, err := svc.CreateVM(context.Background(), &s); err != nil || !async {
		t.Fatalf("CreateVM = %v, %v", async, err)
	}
	svc.Wait()
	rec, err := svc.Get(vm.ModeVM, "dl")
	if err != nil || rec.State != vm.StateFailed {
		t.Fatalf("after failed download: %+v, %v", rec, err)
	}
	e.Host.FailProvision = nil
	s = baseSpec(e)
	s.Vcpus, s.VMID = 1, "next"
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Errorf("a failed VM still holds its vCPU: %v", err)
	}
}

// TestExplicitMACInUse: a MAC another VM uses is refused (400) at admission.
func TestExplicitMACInUse(t *testing.T) {
	e := vmtest.NewEnv(t)
	svc := e.Service(t)
	s := baseSpec(e)
	s.VMID, s.Nets = "a", []vm.NetSpec{{MAC: "02:00:00:00:00:09"}}
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Fatal(err)
	}
	s.VMID, s.Nets = "b", []vm.NetSpec{{}, {MAC: "02:00:00:00:00:09"}}
	_, _, err := svc.CreateVM(context.Background(), &s)
	var fe *vm.FieldError
	if !errors.As(err, &fe) || fe.Field != "nets[1].mac" {
		t.Fatalf("CreateVM with a MAC in use = %v, want a FieldError on nets[1].mac", err)
	}
	s.Nets[1].MAC = "02:00:00:00:00:0a"
	if _, _, err := svc.CreateVM(context.Background(), &s); err != nil {
		t.Errorf("CreateVM with a free MAC = %v", err)
	}
}

func TestParseCPUSet(t *testing.T) {
	for in, want := range map[string]string{"0": "[0]", "0-3,5": "[0 1 2 3 5]", "5,1-2,2": "[1 2 5]", "7-7": "[7]"} {
		got, err := vm.ParseCPUSet(in)
		if err != nil || fmt.Sprint(got) != want {
			t.Errorf("ParseCPUSet(%q) = %v, %v, want %s", in, got, err, want)
		}
	}
	for _, in := range []string{"", ",", "0,", ",0", "a", "1-", "-1", "3-1", "0-8192", "1,,2", "1--2", " 1"} {
		if got, err := vm.ParseCPUSet(in); err == nil {
			t.Errorf("ParseCPUSet(%q) = %v, want an error", in, got)
		}
	}
}

// TestCapacity: totals are host totals times overcommit; only active VMs
// count as used; the disks of a provision in flight count as committed
// until it has written them.
func TestCapacity(t *testing.T) {
	e := vmtest.NewEnv(t)
	e.Config.Overcommit.CPU, e.Config.Overcommit.Memory = 2, 1.5
	svc := e.Service(t)
	ctx := context.Background()
	for _, id := range []string{"a", "b"} {
		s := baseSpec(e)
		s.VMID, s.Vcpus, s.MemoryMB = id, 3, 1024
		if _, _, err := svc.CreateVM(ctx, &s); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := e.Records.Update("b", func(r *vm.Record) { r.State = vm.StateStopped }); err != nil {
		t.Fatal(err)
	}
	c, err := svc.Capacity()
	if err != nil {
		t.Fatal(err)
	}
	if c.DiskTotal == 0 {
		t.Errorf("Capacity.DiskTotal = 0, want the state directory's file system size")
	}
	want := vm.Capacity{HostCPUs: 16, VCPUs: 32, VCPUsUsed: 3, HostMemoryMB: 65536, MemoryMB: 98304, MemoryMBUsed: 1024,
		DiskTotal: c.DiskTotal, DiskFree: 1 << 40}
	if c != want {
		t.Errorf("Capacity = %+v, want %+v", c, want)
	}

	// A create whose provision waits: its 1 GiB base copy and 2 GiB
	// volume are committed, and it holds its vCPUs and memory.
	e.Host.Gate = make(chan struct{})
	s := baseSpec(e)
	s.VMID, s.Vcpus, s.MemoryMB, s.Volumes = "c", 2, 512, []vm.VolumeSpec{{SizeGiB: 2}}
	created := make(chan error, 1)
	go func() { _, _, err := svc.CreateVM(ctx, &s); created <- err }()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if rec, err := svc.Get(vm.ModeVM, "c"); err == nil && rec.Provisioning() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the create never stored its record")
		}
	}
	c, err = svc.Capacity()
	close(e.Host.Gate)
	if cerr := <-created; cerr != nil || err != nil {
		t.Fatalf("create: %v; Capacity: %v", cerr, err)
	}
	want.VCPUsUsed, want.MemoryMBUsed, want.DiskCommitted = 5, 1536, 3<<30
	if c != want {
		t.Errorf("Capacity while c provisions = %+v, want %+v", c, want)
	}
	if c, _ = svc.Capacity(); c.DiskCommitted != 0 {
		t.Errorf("Capacity.DiskCommitted after the provision = %d, want 0", c.DiskCommitted)
	}
}

// TestCreateClaimsInItsFirstWrite: what the host hands out one per VM (a
// confined VM's uid: Host.Claim) is chosen against every other stored
// record and create in flight, under the records' lock, so creates at once
// never get the same, and it is in the create's first record write, before
// any host work; a refused claim refuses the create with nothing stored.
func TestCreateClaimsInItsFirstWrite(t *testing.T) {
	ctx := context.Background()
	e := vmtest.NewEnv(t)
	e.Host.OnClaim = func(rec *vm.Record, others []*vm.Record) error {
		held := map[uint32]bool{}
		for _, o := range others {
			if o.Jail != nil {
				held[o.Jail.UID] = true
			}
		}
		uid := uint32(1000)
		for held[uid] {
			uid++
		}
		if uid > 1007 {
			return &vm.HostError{Kind: vm.HostInternal, Op: "confining VM " + rec.ID, Err: errors.New("no free id in jail.id_range")}
		}
		rec.Jail = &record.Confinement{UID: uid, GID: uid, Cgroup: "vm-" + rec.ID}
		return nil
	}
	e.Host.Gate = make(chan struct{})
	svc := e.Service(t)
	const n = 8
	errs := make(chan error, n)
	for i := range n {
		go func() {
			s := baseSpec(e)
			s.VMID = fmt.Sprintf("c%d", i)
			_, _, err := svc.CreateVM(ctx, &s)
			errs <- err
		}()
	}
	// Every create waits in its provision: what is on disk now is each
	// one's first write.
	for deadline := time.Now().Add(10 * time.Second); len(e.Records.All()) < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d creates stored", len(e.Records.All()), n)
		}
	}
	st, err := store.Open(filepath.Join(e.StateDir, "vms"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	seen := map[uint32]string{}
	for i := range n {
		data, err := st.Get(fmt.Sprintf("c%d", i))
		if err != nil {
			t.Fatal(err)
		}
		r, err := record.Decode(data)
		if err != nil {
			t.Fatal(err)
		}
		if r.Jail == nil {
			t.Fatalf("%s's first write has no jail", r.ID)
		}
		if other, dup := seen[r.Jail.UID]; dup {
			t.Errorf("%s and %s both got uid %d", other, r.ID, r.Jail.UID)
		}
		seen[r.Jail.UID] = r.ID
	}
	close(e.Host.Gate)
	for range n {
		if err := <-errs; err != nil {
			t.Errorf("create: %v", err)
		}
	}
	// The ids are all held: the next create is refused before anything
	// is stored or reaches the host.
	s := baseSpec(e)
	s.VMID = "over"
	_, _, err = svc.CreateVM(ctx, &s)
	var he *vm.HostError
	if !errors.As(err, &he) {
		t.Fatalf("create with every id held = %v, want *HostError", err)
	}
	if e.Records.Get("over") != nil || slices.Contains(e.Host.Calls(), "provision over") {
		t.Errorf("the refused create was stored or provisioned: %v", e.Host.Calls())
	}
}
