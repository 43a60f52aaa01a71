module vmhost

go 1.26.8

require (
	github.com/google/uuid v1.6.0
	github.com/mdlayher/netlink v1.11.2
	github.com/mdlayher/socket v0.8.0
	github.com/mdlayher/vsock v1.4.0
	golang.org/x/net v0.62.0
	golang.org/x/sys v0.49.0
)

require (
	github.com/google/go-cmp v0.7.0 // indirect
	golang.org/x/sync v0.24.0 // indirect
)
