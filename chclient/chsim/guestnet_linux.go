package chsim

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"
)

// guestNIC is the guest side of the VM's first interface while the guest agent runs in a
// network namespace of its own: a tap named eth0 there with the VM's MAC, whose frames the
// simulator pumps to and from the VM's host tap, as CH's virtio-net device would. The
// agent configures it (static or DHCP) like a real guest's NIC.
type guestNIC struct {
	file *os.File
}

// guestIfName is the name of the guest's interface inside its namespace.
const guestIfName = "eth0"

// startInNetns starts cmd in a new network namespace holding the guest's NIC: a locked
// thread unshares its network namespace, creates the tap, forks the agent (a child
// inherits its thread's namespace), and returns to the original namespace.
func startInNetns(cmd *exec.Cmd, mac string) (*guestNIC, error) {
	hw, err := net.ParseMAC(mac)
	if err != nil || len(hw) != 6 {
		return nil, fmt.Errorf("guest MAC %q: %v", mac, err)
	}
	type result struct {
		nic *guestNIC
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		// The thread is unlocked only once back in the original namespace; a thread
		// that cannot get back exits with this goroutine.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			done <- result{err: err}
			runtime.UnlockOSThread()
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			done <- result{err: fmt.Errorf("unsharing the network namespace: %w", err)}
			runtime.UnlockOSThread()
			return
		}
		nic, err := createGuestTap(hw)
		if err == nil {
			if err = cmd.Start(); err != nil {
				nic.file.Close()
			}
		}
		if serr := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); serr == nil {
			runtime.UnlockOSThread()
		}
		done <- result{nic: nic, err: err}
	}()
	r := <-done
	return r.nic, r.err
}

// createGuestTap creates eth0 in the current thread's namespace, opened the way CH opens
// the host tap (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR), so frames cross verbatim, and sets the
// guest's MAC.
func createGuestTap(mac net.HardwareAddr) (*guestNIC, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(guestIfName)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("creating the guest tap: %w", err)
	}
	if err := setHardwareAddr(guestIfName, mac); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return &guestNIC{file: os.NewFile(uintptr(fd), "guest-tap:"+guestIfName)}, nil
}

// setHardwareAddr sets an interface's MAC with SIOCSIFHWADDR.
func setHardwareAddr(name string, mac net.HardwareAddr) error {
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(s)
	// struct ifreq: the name, then struct sockaddr ifr_hwaddr {sa_family; sa_data[14]}.
	var req [40]byte
	copy(req[:unix.IFNAMSIZ], name)
	*(*uint16)(unsafe.Pointer(&req[unix.IFNAMSIZ])) = unix.ARPHRD_ETHER
	copy(req[unix.IFNAMSIZ+2:], mac)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(s), unix.SIOCSIFHWADDR, uintptr(unsafe.Pointer(&req[0]))); errno != 0 {
		return fmt.Errorf("setting the guest MAC: %w", errno)
	}
	return nil
}

// pump copies frames between the guest's tap and the VM's host tap until either closes.
func (n *guestNIC) pump(host *os.File) {
	cp := func(dst, src *os.File) {
		buf := make([]byte, 65536+16)
		for {
			k, err := src.Read(buf)
			if err != nil {
				return // closed: the VM stopped or the guest went away
			}
			if _, err := dst.Write(buf[:k]); err != nil && errors.Is(err, os.ErrClosed) {
				return
			}
		}
	}
	go cp(host, n.file)
	go cp(n.file, host)
}

func (n *guestNIC) close() { n.file.Close() }
