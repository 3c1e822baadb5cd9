// Go's net/http as an agent runs it through a terminated host: the proxy from HTTPS_PROXY
// (http.ProxyFromEnvironment), the CA from SSL_CERT_FILE, the placeholder from GITHUB_TOKEN
// in its Authorization header; standard library only.
//
//	get h1|h2 URL
//
// h2 offers HTTP/2 and HTTP/1.1 by ALPN (the default transport's way); h1 offers HTTP/1.1
// only. Prints "status N HTTP/V", a refusal's code (x-leasegate-refusal: CODE) when there is
// one, and the body, or the error; exits 0 for a 2xx answer, 1 otherwise.
package main

import (
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

func main() {
	transport := &http.Transport{Proxy: http.ProxyFromEnvironment, ForceAttemptHTTP2: true}
	if os.Args[1] == "h1" {
		// A non-nil empty map turns HTTP/2 off.
		transport.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	}
	client := &http.Client{Transport: transport, Timeout: 20 * time.Second}
	request, err := http.NewRequest("GET", os.Args[2], nil)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	request.Header.Set("Authorization", "Bearer "+os.Getenv("GITHUB_TOKEN"))
	response, err := client.Do(request)
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
	// "HTTP/2.0" as Go names it, "HTTP/2" as the others do.
	fmt.Printf("status %d %s\n", response.StatusCode, strings.TrimSuffix(response.Proto, ".0"))
	if refusal := response.Header.Get("X-Leasegate-Refusal"); refusal != "" {
		fmt.Printf("x-leasegate-refusal: %s\n", refusal)
	}
	fmt.Printf("%s", body)
	if response.StatusCode/100 != 2 {
		os.Exit(1)
	}
}
