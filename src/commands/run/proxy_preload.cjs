// Loaded by `leasegate run` into every Node process it starts (NODE_OPTIONS=--require), so
// that Node's own `fetch` and its `http` and `https` modules reach the network through the
// proxy on every Node from 18 on (Node 20 reads no proxy variable at all).
//
// It reads the proxy from HTTPS_PROXY / HTTP_PROXY (either case; `run` sets all of them) and
// NO_PROXY when it loads. Every connection `fetch` or an `http(s).Agent` opens is then a
// CONNECT tunnel through that proxy, carrying the proxy URL's user and password as Basic
// credentials, except to the proxy itself, to a host NO_PROXY names and over a Unix socket. A
// refused CONNECT fails the call with an error naming the refusal:
//
//   Error: leasegate refused CONNECT denied.example:443 for lease <id>: host-denied (…) (403)
//
// (the proxy's one-line answer and its status)
// with `code` ERR_LEASEGATE_REFUSED, `status` and `refusal` (the refusal code) on it; `fetch`
// rejects with `TypeError: fetch failed` whose `cause` is that error. This file holds no
// credential of its own.
'use strict';

(() => {
  // Bun (which reads NODE_OPTIONS too) and Deno read the proxy variables themselves.
  if (process.versions.bun || globalThis.Deno) return;
  const net = require('node:net');
  const tls = require('node:tls');
  const http = require('node:http');
  const https = require('node:https');
  const env = (name) => process.env[name] || process.env[name.toLowerCase()] || '';

  const parse = (value) => {
    if (!value) return null;
    try {
      const url = new URL(value.includes('://') ? value : `http://${value}`);
      if (url.protocol !== 'http:') {
        process.emitWarning(`the proxy ${url.protocol}// is not used: only http:// proxies are`,
          { code: 'LEASEGATE_PROXY' });
        return null;
      }
      const auth = url.username || url.password
        ? decodeURIComponent(url.username) + ':' + decodeURIComponent(url.password)
        : null;
      return { host: url.hostname.replace(/^\[|\]$/g, ''), port: Number(url.port) || 80, auth };
    } catch (error) {
      process.emitWarning(`the proxy ${JSON.stringify(value)} is not a URL: ${error.message}`,
        { code: 'LEASEGATE_PROXY' });
      return null;
    }
  };
  const proxies = {
    'https:': parse(env('HTTPS_PROXY') || env('ALL_PROXY')),
    'http:': parse(env('HTTP_PROXY') || env('ALL_PROXY')),
  };
  if (!proxies['https:'] && !proxies['http:']) return;

  const bare = (host) => String(host || '').replace(/^\[|\]$/g, '').replace(/\.$/, '').toLowerCase();
  const noProxy = env('NO_PROXY').split(/[\s,]+/).filter(Boolean).map((entry) => {
    const v6 = /^\[([^\]]*)\](?::(\d+))?$/.exec(entry);
    const [host, port] = v6 ? [v6[1], v6[2]] : entry.split(':');
    return { host: bare(host).replace(/^\*?\./, '.'), port: port ? Number(port) : null };
  });
  const bypassed = (host, port) => noProxy.some((entry) => {
    if (entry.port && entry.port !== port) return false;
    if (entry.host === '*') return true;
    if (entry.host.startsWith('.')) return host.endsWith(entry.host) || host === entry.host.slice(1);
    return host === entry.host || host.endsWith('.' + entry.host);
  });

  // The proxy for a connection to host:port over `protocol`, or null to go directly.
  const proxyFor = (protocol, host, port) => {
    const proxy = proxies[protocol] || proxies['https:'] || proxies['http:'];
    host = bare(host);
    if (!proxy || bypassed(host, port)) return null;
    if (host === bare(proxy.host) && port === proxy.port) return null;
    return proxy;
  };

  class Refused extends Error {}

  // Opens a CONNECT tunnel to host:port; `done(error, socket)` once the proxy has answered.
  const tunnel = (proxy, host, port, done) => {
    host = bare(host);
    const authority = net.isIPv6(host) ? `[${host}]:${port}` : `${host}:${port}`;
    const socket = net.connect({ host: proxy.host, port: proxy.port });
    let head = `CONNECT ${authority} HTTP/1.1\r\nHost: ${authority}\r\n`;
    if (proxy.auth) {
      head += `Proxy-Authorization: Basic ${Buffer.from(proxy.auth).toString('base64')}\r\n`;
    }
    socket.write(head + '\r\n');
    let read = Buffer.alloc(0);
    let answered = null;
    const finish = (error) => {
      socket.removeListener('readable', onReadable);
      socket.removeListener('error', finish);
      socket.removeListener('end', onEnd);
      if (error) {
        socket.destroy();
        done(error);
      } else {
        done(null, socket);
      }
    };
    const onEnd = () => finish(refusal() || new Error(
      `the proxy ${proxy.host}:${proxy.port} closed the connection before answering CONNECT ${authority}`));
    // What a refusal's answer says: its status line, then its one-line body.
    const refusal = () => {
      if (!answered) return null;
      const body = read.subarray(0, answered.length).toString('utf8').trim();
      const error = new Refused(body ? `${body} (${answered.status})`
        : `leasegate refused CONNECT ${authority}: ${answered.status} ${answered.reason}`);
      error.code = 'ERR_LEASEGATE_REFUSED';
      error.status = answered.status;
      error.refusal = answered.refusal || answered.reason;
      return error;
    };
    const onReadable = () => {
      let chunk;
      while ((chunk = socket.read()) !== null) {
        read = Buffer.concat([read, chunk]);
        if (!answered) {
          const end = read.indexOf('\r\n\r\n');
          if (end < 0) {
            if (read.length > 65536) return finish(new Error(`the proxy's answer to CONNECT ${authority} has no end`));
            continue;
          }
          const [line, ...fields] = read.subarray(0, end).toString('latin1').split('\r\n');
          const status = /^HTTP\/1\.[01] (\d{3}) ?(.*)$/.exec(line);
          const header = (name) => fields.map((f) => f.split(/:\s*/))
            .find(([n]) => n.toLowerCase() === name)?.slice(1).join(':');
          read = read.subarray(end + 4);
          if (status && status[1] === '200') {
            if (read.length) socket.unshift(read);
            return finish(null);
          }
          answered = {
            status: status ? Number(status[1]) : 0,
            reason: status ? status[2] : line,
            refusal: header('x-leasegate-refusal'),
            length: Math.min(Number(header('content-length')) || 0, 4096),
          };
        }
        if (read.length >= answered.length) return finish(refusal());
      }
    };
    socket.on('readable', onReadable);
    socket.on('error', finish);
    socket.on('end', onEnd);
  };

  // Node's `fetch` (its own undici): its global dispatcher, an Agent whose connections are
  // tunnels. The Agent class is the one Node bundles, found through the dispatcher it makes.
  const dispatcherKey = Symbol.for('undici.globalDispatcher.1');
  void globalThis.Headers; // loads Node's undici, which sets its global dispatcher
  const made = globalThis[dispatcherKey];
  const Agent = made && [made, ...Object.getOwnPropertySymbols(made).map((s) => made[s])]
    .find((value) => value && value.constructor && value.constructor.name === 'Agent')?.constructor;
  if (Agent) {
    const connect = (options, done) => {
      const port = Number(options.port) || (options.protocol === 'https:' ? 443 : 80);
      const proxy = proxyFor(options.protocol, options.hostname, port);
      const direct = () => {
        const socket = options.protocol === 'https:'
          ? tls.connect({ host: options.hostname, port, servername: options.servername || options.hostname, ALPNProtocols: ['http/1.1'] })
          : net.connect({ host: options.hostname, port });
        const ready = options.protocol === 'https:' ? 'secureConnect' : 'connect';
        socket.once(ready, () => { socket.removeListener('error', done); done(null, socket); });
        socket.once('error', done);
      };
      if (!proxy) return direct();
      tunnel(proxy, options.hostname, port, (error, socket) => {
        if (error) return done(error);
        if (options.protocol !== 'https:') return done(null, socket);
        const secured = tls.connect({
          socket,
          servername: options.servername || (net.isIP(bare(options.hostname)) ? undefined : bare(options.hostname)),
          ALPNProtocols: ['http/1.1'],
        });
        secured.once('secureConnect', () => { secured.removeListener('error', done); done(null, secured); });
        secured.once('error', done);
      });
    };
    globalThis[dispatcherKey] = new Agent({ connect });
  } else {
    process.emitWarning('Node\'s fetch cannot be pointed at the proxy (its Agent was not found): ' +
      'give it one with undici\'s EnvHttpProxyAgent', { code: 'LEASEGATE_PROXY' });
  }

  // `http` and `https`: every Agent's connections (the global ones, and any made later).
  const plainConnection = http.Agent.prototype.createConnection;
  http.Agent.prototype.createConnection = function createConnection(options, done) {
    const port = Number(options.port) || 80;
    const proxy = !options.socketPath && proxyFor('http:', options.host, port);
    if (!proxy) return plainConnection.call(this, options, done);
    tunnel(proxy, options.host, port, done);
    return undefined;
  };
  const tlsConnection = https.Agent.prototype.createConnection;
  https.Agent.prototype.createConnection = function createConnection(options, done) {
    const port = Number(options.port) || 443;
    const proxy = !options.socketPath && proxyFor('https:', options.host, port);
    if (!proxy) return tlsConnection.call(this, options, done);
    tunnel(proxy, options.host, port, (error, socket) => {
      if (error) return done(error);
      const host = bare(options.host);
      const servername = options.servername || (net.isIP(host) ? undefined : host);
      done(null, tls.connect({ ...options, socket, servername, path: undefined }));
    });
    return undefined;
  };
})();
