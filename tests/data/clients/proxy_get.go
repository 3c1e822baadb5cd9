// A plain Go client for the clients tests, standard library only: GET one URL through the
// proxy that HTTPS_PROXY / HTTP_PROXY name (http.ProxyFromEnvironment), trusting the CA file
// that SSL_CERT_FILE names. Go never sends requests for localhost or a loopback address
// through a proxy, so the tests use names the proxy resolves (origin.test).
//
//	go run proxy_get.go URL
//
// Prints "status N" and the body, or the error, and exits 0 for a 2xx answer, 1 otherwise.
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"time"
)

func main() {
	client := &http.Client{
		Transport: &http.Transport{Proxy: http.ProxyFromEnvironment},
		Timeout:   20 * time.Second,
	}
	response, err := client.Get(os.Args[1])
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	defer response.Body.Close()
	body, err := io.ReadAll(response.Body)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Printf("status %d\n%s", response.StatusCode, body)
	if response.StatusCode/100 != 2 {
		os.Exit(1)
	}
}
