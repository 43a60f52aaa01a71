package main

import (
	"net/http"

	"vmhost/api"
	"vmhost/appvm"
	"vmhost/vm"
)

// service is what serve runs: the API handler over the VM services.
type service struct {
	Handler http.Handler
}

// newService loads the VM records and builds the API over them. Host work
// is vm.NotBuiltHost until the engine issue lands: a create that needs it
// answers 500 INTERNAL naming the part that is not built yet.
func newService(env serveEnv) (*service, error) {
	vms, err := vm.New(vm.Options{
		StateDir: env.StateDir,
		RunDir:   env.RunDir,
		Config:   env.Config,
		Store:    env.Store,
		Host:     vm.NotBuiltHost{},
		Logger:   env.Log,
	})
	if err != nil {
		return nil, err
	}
	r := vms.Report()
	env.Log.Info("loaded VM records", "loaded", r.Loaded, "invalid_id", len(r.Invalid),
		"damaged", len(r.Damaged), "undecodable", len(r.Undecodable), "removed_temps", len(r.RemovedTemps))
	h := api.New(api.Config{Keys: env.Keys, VMs: vms, AppVMs: appvm.New(vms), Logger: env.Log})
	return &service{Handler: h}, nil
}
