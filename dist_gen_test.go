package main

import (
	"flag"
	"os"
	"testing"

	"vmhost/config"
)

var updateDist = flag.Bool("update-dist", false, "rewrite dist/config.json from config.Default")

// TestDistConfig: the packaged /etc/vmhost/config.json is the built-in
// default, so installing the package changes nothing until the operator
// edits it. go test -run TestDistConfig -update-dist rewrites it.
func TestDistConfig(t *testing.T) {
	want, err := config.Default().Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if *updateDist {
		if err := os.WriteFile("dist/config.json", want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile("dist/config.json")
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(want) {
		t.Errorf("dist/config.json differs from config.Default(); run go test -run TestDistConfig -update-dist .\ngot:\n%s\nwant:\n%s", got, want)
	}
	if _, err := config.Load("dist/config.json"); err != nil {
		t.Errorf("dist/config.json does not load: %v", err)
	}
}
