// Command hello is the workload of the quick start's AppVM: it says hello
// with what the AppVM gave it (its hostname, its arguments, $GREETING),
// then waits for the stop the agent sends (SIGTERM) and says goodbye.
// `hello --check` is its health check: it answers at once. build.sh packs
// it, alone, as a container image.
package main

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "--check" {
		fmt.Println("ok")
		return
	}
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	host, _ := os.Hostname()
	greeting := os.Getenv("GREETING")
	if greeting == "" {
		greeting = "hello"
	}
	fmt.Printf("%s from %s (args %q, pid %d)\n", greeting, host, strings.Join(os.Args[1:], " "), os.Getpid())
	s := <-stop
	fmt.Printf("%s: goodbye\n", s)
}
