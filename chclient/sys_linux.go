package chclient

import "syscall"

const syscallNonblock = syscall.O_NONBLOCK
