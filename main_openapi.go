package main

import (
	"fmt"
	"io"

	"vmhost/api"
)

// openAPICmd prints the API's OpenAPI 3.1 document, the one the agent
// serves at GET /api/openapi.json, for client generators and linters.
func openAPICmd(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintln(stderr, "usage: vmhost openapi")
		return 2
	}
	doc, err := api.OpenAPI()
	if err != nil {
		fmt.Fprintf(stderr, "vmhost openapi: %v\n", err)
		return 1
	}
	stdout.Write(append(doc, '\n'))
	return 0
}
