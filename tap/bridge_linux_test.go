package tap

import (
	"encoding/json"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"testing"

	"github.com/mdlayher/netlink"
	"github.com/mdlayher/netlink/nltest"
	"golang.org/x/sys/unix"
)

// fakeRoute is an rtnetlink peer for message-level tests: it answers
// RTM_GETLINK from a fixed set of links, acks every change, and records each
// change as one transcript line naming the exact attributes.
type fakeRoute struct {
	links      []link
	transcript []string
	// fail maps a transcript line prefix to the errno the kernel answers.
	fail map[string]unix.Errno
}

func (f *fakeRoute) handle(reqs []netlink.Message) ([]netlink.Message, error) {
	if len(reqs) != 1 {
		return nil, fmt.Errorf("fake: %d messages in one send", len(reqs))
	}
	req := reqs[0]
	hdr := req.Data[:unix.SizeofIfInfomsg]
	index := int(int32(nativeUint32(hdr[4:8])))
	if req.Header.Type == unix.RTM_GETLINK {
		name := ""
		ad, _ := netlink.NewAttributeDecoder(req.Data[unix.SizeofIfInfomsg:])
		for ad.Next() {
			if ad.Type() == unix.IFLA_IFNAME {
				name = ad.String()
			}
		}
		for _, l := range f.links {
			if (index != 0 && l.Index == index) || (index == 0 && l.Name == name) {
				m := linkReply(l)
				m.Header.Sequence, m.Header.PID = req.Header.Sequence, req.Header.PID
				return []netlink.Message{m}, nil
			}
		}
		return nltest.Error(int(unix.ENODEV), reqs)
	}
	line := fmt.Sprintf("%s family=%d index=%d flags=%x/%x %s", msgTypeName(req.Header.Type), hdr[0], index,
		nativeUint32(hdr[8:12]), nativeUint32(hdr[12:16]), dumpAttrs("", req.Data[unix.SizeofIfInfomsg:]))
	f.transcript = append(f.transcript, line)
	for prefix, errno := range f.fail {
		if strings.HasPrefix(line, prefix) {
			return nltest.Error(int(errno), reqs)
		}
	}
	return nltest.Error(0, reqs)
}

func nativeUint32(b []byte) uint32 {
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func msgTypeName(t netlink.HeaderType) string {
	switch t {
	case unix.RTM_NEWLINK:
		return "RTM_NEWLINK"
	case unix.RTM_DELLINK:
		return "RTM_DELLINK"
	case unix.RTM_SETLINK:
		return "RTM_SETLINK"
	}
	return fmt.Sprintf("type%d", t)
}

var attrNames = map[string]string{
	"3":       "IFLA_IFNAME",
	"4":       "IFLA_MTU",
	"10":      "IFLA_MASTER",
	"18":      "IFLA_LINKINFO",
	"18/4":    "IFLA_INFO_SLAVE_KIND",
	"18/5":    "IFLA_INFO_SLAVE_DATA",
	"18/5/33": "IFLA_BRPORT_ISOLATED",
	"20":      "IFLA_IFALIAS",
	"26":      "IFLA_AF_SPEC",
	"26/2":    "IFLA_BRIDGE_VLAN_INFO",
}

// dumpAttrs renders attributes as NAME=hex, recursing into nested ones.
func dumpAttrs(path string, b []byte) string {
	ad, err := netlink.NewAttributeDecoder(b)
	if err != nil {
		return "!" + err.Error()
	}
	var parts []string
	for ad.Next() {
		p := fmt.Sprint(ad.Type())
		if path != "" {
			p = path + "/" + p
		}
		name := attrNames[p]
		if name == "" {
			name = "attr" + p
		}
		if ad.TypeFlags()&unix.NLA_F_NESTED != 0 {
			parts = append(parts, name+"{"+dumpAttrs(p, ad.Bytes())+"}")
		} else {
			parts = append(parts, fmt.Sprintf("%s=%x", name, ad.Bytes()))
		}
	}
	return strings.Join(parts, " ")
}

// linkReply encodes l as the kernel's RTM_NEWLINK answer to RTM_GETLINK.
func linkReply(l link) netlink.Message {
	ae := netlink.NewAttributeEncoder()
	ae.String(unix.IFLA_IFNAME, l.Name)
	if l.Master != 0 {
		ae.Uint32(unix.IFLA_MASTER, uint32(l.Master))
	}
	ae.Nested(unix.IFLA_LINKINFO, func(nae *netlink.AttributeEncoder) error {
		nae.String(unix.IFLA_INFO_KIND, l.Kind)
		if l.Kind == "bridge" {
			nae.Nested(unix.IFLA_INFO_DATA, func(dae *netlink.AttributeEncoder) error {
				dae.Uint8(unix.IFLA_BR_VLAN_FILTERING, boolByte(l.VLANFiltering))
				return nil
			})
		}
		return nil
	})
	attrs, err := ae.Encode()
	if err != nil {
		panic(err)
	}
	return netlink.Message{
		Header: netlink.Header{Type: unix.RTM_NEWLINK},
		Data:   append(ifInfo{Index: int32(l.Index)}.marshal(), attrs...),
	}
}

func fakeHandle(f *fakeRoute) *Handle {
	h := New(nil)
	h.dial = func(family int) (*netlink.Conn, error) {
		if family != unix.NETLINK_ROUTE {
			return nil, fmt.Errorf("fake: family %d", family)
		}
		return nltest.Dial(f.handle), nil
	}
	return h
}

func TestAttachMessages(t *testing.T) {
	const (
		master   = "RTM_NEWLINK family=0 index=5 flags=0/0 IFLA_MASTER=03000000"
		isoOn    = "RTM_NEWLINK family=0 index=5 flags=0/0 IFLA_LINKINFO{IFLA_INFO_SLAVE_KIND=62726964676500 IFLA_INFO_SLAVE_DATA{IFLA_BRPORT_ISOLATED=01}}"
		isoOff   = "RTM_NEWLINK family=0 index=5 flags=0/0 IFLA_LINKINFO{IFLA_INFO_SLAVE_KIND=62726964676500 IFLA_INFO_SLAVE_DATA{IFLA_BRPORT_ISOLATED=00}}"
		pvid42   = "RTM_SETLINK family=7 index=5 flags=0/0 IFLA_AF_SPEC{IFLA_BRIDGE_VLAN_INFO=06002a00}"
		pvid1    = "RTM_SETLINK family=7 index=5 flags=0/0 IFLA_AF_SPEC{IFLA_BRIDGE_VLAN_INFO=06000100}"
		pvid4094 = "RTM_SETLINK family=7 index=5 flags=0/0 IFLA_AF_SPEC{IFLA_BRIDGE_VLAN_INFO=0600fe0f}"
		delVLAN1 = "RTM_DELLINK family=7 index=5 flags=0/0 IFLA_AF_SPEC{IFLA_BRIDGE_VLAN_INFO=00000100}"
	)
	tests := []struct {
		name      string
		filtering bool
		onBridge  bool
		opts      PortOptions
		fail      map[string]unix.Errno
		want      []string
		wantErr   error
	}{
		{name: "isolated, vlan on a filtering bridge", filtering: true, opts: PortOptions{Isolated: true, VLAN: 42},
			want: []string{master, isoOn, pvid42, delVLAN1}},
		{name: "vlan 4094, already a port", filtering: true, onBridge: true, opts: PortOptions{VLAN: 4094},
			want: []string{isoOff, pvid4094, delVLAN1}},
		{name: "vlan 1 keeps vlan 1", filtering: true, opts: PortOptions{VLAN: 1},
			want: []string{master, isoOff, pvid1}},
		{name: "vlan without filtering is metadata", filtering: false, opts: PortOptions{Isolated: true, VLAN: 42},
			want: []string{master, isoOn}},
		{name: "no vlan", filtering: true, opts: PortOptions{},
			want: []string{master, isoOff}},
		{name: "vlan 1 already gone", filtering: true, opts: PortOptions{VLAN: 42},
			fail: map[string]unix.Errno{delVLAN1: unix.ENOENT},
			want: []string{master, isoOff, pvid42, delVLAN1}},
		{name: "kernel refuses vlan", filtering: true, opts: PortOptions{VLAN: 42},
			fail: map[string]unix.Errno{pvid42: unix.EOPNOTSUPP},
			want: []string{master, isoOff, pvid42}, wantErr: unix.EOPNOTSUPP},
		{name: "kernel refuses isolation", filtering: true, opts: PortOptions{Isolated: true},
			fail: map[string]unix.Errno{isoOn: unix.EOPNOTSUPP},
			want: []string{master, isoOn}, wantErr: unix.EOPNOTSUPP},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tapLink := link{Index: 5, Name: "vmhtap0", Kind: "tun"}
			if tt.onBridge {
				tapLink.Master = 3
			}
			f := &fakeRoute{
				links: []link{{Index: 3, Name: "br0", Kind: "bridge", VLANFiltering: tt.filtering}, tapLink},
				fail:  tt.fail,
			}
			err := fakeHandle(f).Attach(t.Context(), "vmhtap0", "br0", tt.opts)
			if !errors.Is(err, tt.wantErr) || (err != nil) != (tt.wantErr != nil) {
				t.Errorf("Attach = %v, want %v", err, tt.wantErr)
			}
			got, want := strings.Join(f.transcript, "\n"), strings.Join(tt.want, "\n")
			if got != want {
				t.Errorf("messages sent:\n%s\nwant:\n%s", got, want)
			}
		})
	}
}

// TestIntegrationVLAN checks the PVID on a live VLAN-filtering bridge, where
// the kernel has them (CONFIG_BRIDGE_VLAN_FILTERING).
func TestIntegrationVLAN(t *testing.T) {
	ns := newTestNS(t)
	if err := ns.addBridge("br0", true); errors.Is(err, unix.EOPNOTSUPP) {
		t.Skipf("this kernel has no bridge VLAN filtering: creating a bridge with vlan_filtering=1 answered %v; the VLAN messages are checked by TestAttachMessages", err)
	} else if err != nil {
		t.Fatal(err)
	}
	bridgeCmd, err := exec.LookPath("bridge")
	if err != nil {
		t.Skip("needs the bridge command (iproute2) to read VLANs back")
	}
	ns.createTap("t0", 0)
	if err := ns.h.Attach(t.Context(), "t0", "br0", PortOptions{VLAN: 42}); err != nil {
		t.Fatalf("Attach with VLAN 42 = %v", err)
	}
	var out []byte
	if err := ns.run(func() error {
		var err error
		out, err = exec.Command(bridgeCmd, "-j", "vlan", "show", "dev", "t0").Output()
		return err
	}); err != nil {
		t.Fatalf("bridge vlan show: %v", err)
	}
	var ports []struct {
		Vlans []struct {
			Vlan  int      `json:"vlan"`
			Flags []string `json:"flags"`
		} `json:"vlans"`
	}
	if err := json.Unmarshal(out, &ports); err != nil || len(ports) != 1 {
		t.Fatalf("bridge -j vlan show = %s (%v)", out, err)
	}
	vlans := ports[0].Vlans
	if len(vlans) != 1 || vlans[0].Vlan != 42 || strings.Join(vlans[0].Flags, ",") != "PVID,Egress Untagged" {
		t.Errorf("port vlans = %s, want only 42 as PVID, egress untagged", out)
	}
}
