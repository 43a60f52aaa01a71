// Command vsockguest runs inside the qemu backend's test guest (built static, put in its
// initramfs): it dials the host (CID 2) on the port given as its first argument and writes
// a line, then serves one connection on the port given second, echoing what it reads with a
// prefix. It reports on stdout, the guest's serial console.
package main

import (
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Println("vsockguest: usage: vsockguest HOSTPORT LISTENPORT")
		os.Exit(2)
	}
	hostPort, _ := strconv.ParseUint(os.Args[1], 10, 32)
	listenPort, _ := strconv.ParseUint(os.Args[2], 10, 32)

	l, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0)
	if err != nil {
		fmt.Println("vsockguest: socket:", err)
		os.Exit(1)
	}
	if err := unix.Bind(l, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: uint32(listenPort)}); err != nil {
		fmt.Println("vsockguest: bind:", err)
		os.Exit(1)
	}
	if err := unix.Listen(l, 1); err != nil {
		fmt.Println("vsockguest: listen:", err)
		os.Exit(1)
	}

	fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM, 0)
	if err == nil {
		err = unix.Connect(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_HOST, Port: uint32(hostPort)})
	}
	if err != nil {
		fmt.Println("vsockguest: dialing the host:", err)
		os.Exit(1)
	}
	unix.Write(fd, []byte("hello from the guest\n"))
	unix.Close(fd)
	fmt.Println("vsockguest: listening")

	c, _, err := unix.Accept(l)
	if err != nil {
		fmt.Println("vsockguest: accept:", err)
		os.Exit(1)
	}
	b := make([]byte, 256)
	n, _ := unix.Read(c, b)
	unix.Write(c, append([]byte("echo:"), b[:n]...))
	unix.Close(c)
	fmt.Println("vsockguest: done")
}
