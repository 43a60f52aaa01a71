package record

import (
	"bytes"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestRecordRoundTripKeepsSecrets(t *testing.T) {
	size := uint32(3)
	r := &Record{
		ID: "r1", Mode: ModeAppVM, State: StateCreated, DisplayState: "created",
		CreatedAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC),
		Spec:      Spec{VMID: "r1", Vcpus: 1, MemoryMB: 64, Disk: &DiskSpec{SizeGiB: &size}},
		NICs:      []NIC{{MAC: "02:00:00:00:00:01", Tap: TapName("r1", 0)}},
		AppVM:     &AppVMSpec{ImageID: "img", NetworkMode: "dhcp", RestartPolicy: "no", SecretEnvKeys: []string{"K"}},
		Secrets: Secrets{Password: "pw-x", SecretEnv: []SecretEnv{{Key: "K", Value: "sv-y"}},
			Files: []SecretFile{{Path: "/run/key", Mode: 0o400, Content: "sf-z"}}},
	}
	b, err := Encode(r)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte("pw-x")) || !bytes.Contains(b, []byte("sv-y")) || !bytes.Contains(b, []byte("sf-z")) {
		t.Fatalf("record file lacks its secrets:\n%s", b)
	}
	got, err := Decode(b)
	if err != nil {
		t.Fatal(err)
	}
	b2, _ := Encode(got)
	if !bytes.Equal(b, b2) {
		t.Errorf("round trip differs:\n%s\n%s", b, b2)
	}
	if len(got.Secrets.Files) != 1 || got.Secrets.Files[0].Content.Reveal() != "sf-z" || got.Secrets.Files[0].Mode != 0o400 {
		t.Errorf("secret file after a round trip: %+v", got.Secrets.Files)
	}
	if s := fmt.Sprintf("%v %+v %#v %s %v", got.Secrets, got.Secrets, got.Secrets.Password, got.Secrets.SecretEnv, got.Secrets.Files); bytes.Contains([]byte(s), []byte("pw-x")) || bytes.Contains([]byte(s), []byte("sv-y")) || bytes.Contains([]byte(s), []byte("sf-z")) {
		t.Errorf("formatting leaks a secret: %s", s)
	}
	if len(TapName("r1", MaxNets-1)) > 15 {
		t.Errorf("tap name %q exceeds IFNAMSIZ", TapName("r1", MaxNets-1))
	}
}

// FuzzDecodeRecord: no record file, however damaged, panics the loader,
// and whatever decodes encodes and decodes again to the same bytes.
func FuzzDecodeRecord(f *testing.F) {
	f.Add([]byte(`{"id":"a","mode":"vm","state":"created","spec":{"vcpus":1,"memory_mb":64},"secrets":{"password":"p"}}`))
	f.Add([]byte(`{"id":"a","mode":"appvm","appvm":{"image_id":"i","network_mode":"dhcp","restart_policy":"no","booted":true,"image":{}}}`))
	f.Add([]byte(`{"mode":"x"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := Decode(data)
		if err != nil {
			return
		}
		b, err := Encode(r)
		if err != nil {
			t.Fatalf("decoded record does not encode: %v", err)
		}
		r2, err := Decode(b)
		if err != nil {
			t.Fatalf("re-decoding %s: %v", b, err)
		}
		if b2, _ := Encode(r2); !bytes.Equal(b, b2) {
			t.Fatalf("not stable:\n%s\n%s", b, b2)
		}
	})
}

func TestFailureDetailCheck(t *testing.T) {
	code := 0
	for _, tc := range []struct {
		d  FailureDetail
		ok bool
	}{
		{FailureDetail{Kind: KindProcessExit, Code: &code}, true},
		{FailureDetail{Kind: KindProcessExit}, false},
		{FailureDetail{Kind: KindProcessSignal}, false},
		{FailureDetail{Kind: KindDiskMissing}, false},
		{FailureDetail{Kind: KindDiskMissing, Path: "/x"}, true},
		{FailureDetail{Kind: KindBootTimeout}, false},
		{FailureDetail{Kind: KindMissingPID}, true},
	} {
		if err := tc.d.Check(); (err == nil) != tc.ok {
			t.Errorf("%+v: Check() = %v", tc.d, err)
		}
	}
}

// TestDecodeMovesV1DataVolumes: an AppVM record written before volumes
// held their mountpoints (appvm.data_volumes, parallel to spec.volumes;
// testdata/appvm-v1-data-volumes.json is one as that version wrote it)
// loads with each mountpoint on its volume, and is written back without
// the old list; its provisioning steps are kept as they were.
func TestDecodeMovesV1DataVolumes(t *testing.T) {
	old, err := os.ReadFile("testdata/appvm-v1-data-volumes.json")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(old, []byte(`"data_volumes"`)) {
		t.Fatal("the testdata record is not in the old shape")
	}
	r, err := Decode(old)
	if err != nil {
		t.Fatal(err)
	}
	want := []VolumeSpec{{ID: "data0", SizeGiB: 1, Mountpoint: "/var/lib/data"}, {ID: "data1", SizeGiB: 2, Mountpoint: "/srv/cache"}}
	if !reflect.DeepEqual(r.Spec.Volumes, want) {
		t.Errorf("volumes = %+v, want %+v", r.Spec.Volumes, want)
	}
	if got := r.Mounts(); len(got) != 2 || got[0] != (Mount{Device: "/dev/vdb", Mountpoint: "/var/lib/data"}) || got[1] != (Mount{Device: "/dev/vdc", Mountpoint: "/srv/cache"}) {
		t.Errorf("mounts = %+v", got)
	}
	if !r.Runtime.Done(StepData(1)) || r.Runtime.VsockCID != 3 {
		t.Errorf("runtime = %+v", r.Runtime)
	}
	b, err := Encode(r)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("data_volumes")) || !bytes.Contains(b, []byte(`"mountpoint": "/srv/cache"`)) {
		t.Errorf("written back:\n%s", b)
	}
	again, err := Decode(b)
	if err != nil || !reflect.DeepEqual(again.Spec.Volumes, want) {
		t.Errorf("the new shape read again: %+v, %v", again.Spec.Volumes, err)
	}
}

// TestCloudInitIdentity: the request's hostname, user and instance-id,
// else their defaults: the VM id's hostname (ClassicHostname, case kept),
// root, the VM id.
func TestCloudInitIdentity(t *testing.T) {
	h, u, iid := "web", "alice", "migrated-7"
	for _, tc := range []struct {
		id   string
		ci   CloudInitSpec
		want CloudInitIdentity
	}{
		{"My_VM.01", CloudInitSpec{}, CloudInitIdentity{Hostname: "My-VM-01", User: "root", InstanceID: "My_VM.01"}},
		{"_-_", CloudInitSpec{}, CloudInitIdentity{Hostname: "vm", User: "root", InstanceID: "_-_"}},
		{"x." + strings.Repeat("y", 70), CloudInitSpec{}, CloudInitIdentity{Hostname: "x-" + strings.Repeat("y", 61), User: "root", InstanceID: "x." + strings.Repeat("y", 70)}},
		{"vm1", CloudInitSpec{Hostname: &h, User: &u, InstanceID: &iid}, CloudInitIdentity{Hostname: "web", User: "alice", InstanceID: "migrated-7"}},
	} {
		if got := tc.ci.Identity(tc.id); got != tc.want {
			t.Errorf("Identity(%q) = %+v, want %+v", tc.id, got, tc.want)
		}
	}
}
